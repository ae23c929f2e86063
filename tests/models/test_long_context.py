"""YaRN-scaled Qwen3 equals Hugging Face past the original window; the context limit it implies is enforced."""

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.config import model_max_len
from tests.helpers import hf_greedy, save_tiny_model, tiny_config

TRAINED = 64  # the tiny model's "pretrained" window; YaRN x4 stretches it to 256 positions
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAINED}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompts():
    import torch
    g = torch.Generator().manual_seed(3)
    # every prompt runs past the trained window, the longest to the end of the stretched one
    return [torch.randint(3, 380, (n,), generator=g).tolist() for n in (TRAINED + 9, 150, 4 * TRAINED - 8)]


@pytest.fixture(scope="module")
def yarn_qwen3(tmp_path_factory):
    return save_tiny_model("qwen3", tmp_path_factory.mktemp("yarn-qwen3"), seed=7,
                           max_position_embeddings=TRAINED, rope_scaling=YARN)


def test_yarn_limit_is_the_stretched_window():
    assert model_max_len(tiny_config("qwen3", max_position_embeddings=TRAINED, rope_scaling=YARN)) == 4 * TRAINED
    assert model_max_len(tiny_config("qwen3", max_position_embeddings=TRAINED)) == TRAINED


def test_yarn_greedy_equals_hf_past_the_trained_window(yarn_qwen3):
    batch = prompts()
    expected, _ = hf_greedy(yarn_qwen3, batch, GREEDY.max_tokens)
    # small chunks: positions past the trained window are reached by cached context as well as by queries
    llm = LLM(yarn_qwen3, kvcache_block_size=16, num_kvcache_blocks=128, max_num_batched_tokens=64)
    assert llm.max_model_len == 4 * TRAINED
    assert [o.token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)] == expected


def test_yarn_changes_the_tokens(tmp_path, yarn_qwen3):
    # the same weights without the scaling give other tokens at these positions: the test above can fail
    plain = save_tiny_model("qwen3", tmp_path / "plain", seed=7, max_position_embeddings=4 * TRAINED)
    batch = prompts()
    assert hf_greedy(plain, batch, GREEDY.max_tokens)[0] != hf_greedy(yarn_qwen3, batch, GREEDY.max_tokens)[0]


def test_context_beyond_the_stretched_window_is_refused(yarn_qwen3):
    with pytest.raises(ValueError, match=r"max_model_len 300 is beyond the model's limit of 256"):
        LLM(yarn_qwen3, max_model_len=300, num_kvcache_blocks=32)
    llm = LLM(yarn_qwen3, kvcache_block_size=16, num_kvcache_blocks=32)
    with pytest.raises(ValueError, match="the prompt has 300 tokens, but max_model_len is 256"):
        llm.generate([[5] * 300], GREEDY, use_tqdm=False)
