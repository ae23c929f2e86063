"""Every model family equals Hugging Face transformers on a tiny random model; loading errors are clear."""

import os

import pytest
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from tests.helpers import hf_greedy, save_tiny_model

PROMPTS = [[5], [7, 8, 9, 10] * 5, list(range(3, 140)), [200] * 33]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("family, overrides", [
    ("llama", {}),  # llama3 RoPE scaling
    ("llama", {"attention_bias": True, "tie_word_embeddings": True, "num_key_value_heads": 4}),
    ("qwen2", {}),  # q/k/v bias
    ("qwen3", {"tie_word_embeddings": True}),
])
def test_family_greedy_equals_hf(tmp_path, family, overrides):
    path = save_tiny_model(family, tmp_path / family, seed=5, **overrides)
    expected, _ = hf_greedy(path, PROMPTS, 8)
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=128)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


def test_llama3_rope_scaling_is_applied(tmp_path):
    # the same weights without the scaling must give other logits at long positions
    from nanovllm.layers.rotary import inverse_frequencies
    from tests.helpers import tiny_config
    scaled, _ = inverse_frequencies(tiny_config("llama"), 16)
    plain, _ = inverse_frequencies(tiny_config("llama", rope_scaling=None), 16)
    assert not (scaled == plain).all()


@pytest.mark.parametrize("family, tensor", [
    ("qwen3", "model.layers.1.mlp.down_proj.weight"),
    ("qwen3_moe", "model.layers.2.mlp.experts.5.up_proj.weight"),  # one expert's slice of a stacked parameter
])
def test_missing_tensor_is_named(tmp_path, family, tensor):
    path = save_tiny_model(family, tmp_path / "m")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors[tensor]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=tensor.replace(".", r"\.")):
        LLM(path, num_kvcache_blocks=8)


def test_unexpected_tensor_is_named(tmp_path):
    path = save_tiny_model("qwen3", tmp_path / "m")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["model.layers.0.mlp.extra.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.0.mlp.extra.weight"):
        LLM(path, num_kvcache_blocks=8)


def test_unknown_architecture_lists_supported(tmp_path):
    import json
    path = save_tiny_model("qwen3", tmp_path / "m")
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["architectures"] = ["GPT2LMHeadModel"]
    with open(config_file, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError) as err:
        LLM(path, num_kvcache_blocks=8)
    for name in ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(err.value)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_dummy_weights_from_config_only(tmp_path, family):
    import json

    from tests.helpers import tiny_config
    folder = tmp_path / "shape"
    folder.mkdir()
    with open(folder / "config.json", "w") as f:
        json.dump(tiny_config(family).to_dict(), f)
    llm = LLM(str(folder), load_format="dummy", num_kvcache_blocks=16)
    out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]
    assert len(out.token_ids) == 8 and out.text == ""
