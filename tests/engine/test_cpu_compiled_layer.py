"""On block weights (the CPU's default) each dense decoder layer runs as one compiled call
(platforms/cpu/decoder_layer.py): the general layer's tokens and logprobs bit for bit, in prefill chunks, decodes,
mixed steps and over a cached prefix; a step it cannot take runs the general forward."""

from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.platforms.cpu import cpu_ops, decoder_layer
from tests.helpers import save_tiny_model

KWARGS = dict(kvcache_block_size=16, num_kvcache_blocks=48, max_model_len=128, max_num_batched_tokens=40)


@pytest.fixture
def unpinned(monkeypatch):
    """The environment of a user: the suite's NANOVLLM_CPU_DTYPE=float32 unset (the default: block weights)."""
    monkeypatch.delenv("NANOVLLM_CPU_DTYPE", raising=False)


@pytest.fixture
def layer_calls(monkeypatch) -> list[int]:
    """The rows of every compiled layer call."""
    lib = cpu_ops.load()
    assert lib is not None, "this machine has a C compiler (the suite's CPU kernels need it)"
    calls: list[int] = []
    original = lib.decoder_layer_blocks_f32

    def spy(layer, step, *args):
        calls.append(decoder_layer._StepArgs.from_address(step).rows)
        return original(layer, step, *args)

    monkeypatch.setattr(lib, "decoder_layer_blocks_f32", spy)
    return calls


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (1, 9, 57)]
    prompts.append(prompts[2][:32] + [5, 6, 7])  # its first two blocks cached by the prompt before it
    return prompts


def _run(path: str, **kwargs) -> tuple[list[tuple[list[int], list]], int, int]:
    llm = LLM(path, **KWARGS, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=3)
    outputs = llm.generate(_prompts(), params, use_tqdm=False)
    compiled = sum(isinstance(m, decoder_layer.CpuBlockDecoderLayer) for m in llm.runner.model.modules())
    hits = llm.scheduler.block_manager.num_hit_tokens
    llm.close()
    return [(o["token_ids"], o["logprobs"]) for o in outputs], compiled, hits


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])  # q/k norms; q/k/v bias; llama3's RoPE scaling
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])  # auto: float16 under block weights
def test_the_compiled_layer_is_the_general_one_bit_for_bit(family, kv_cache_dtype, unpinned, layer_calls, tmp_path,
                                                           monkeypatch):
    path = save_tiny_model(family, tmp_path / family)
    compiled_out, compiled, hits = _run(path, kv_cache_dtype=kv_cache_dtype)
    assert compiled == 2 and hits == 32
    # prefill chunks of <= 40 tokens, some steps mixed with decodes, then decodes of all four (2 layers a step)
    # two layers a step: prefill chunks at the budget of 40 tokens (the second with the first decodes), then decode
    # steps of all four requests
    assert len(layer_calls) % 2 == 0 and layer_calls[:2] == [40, 40] and layer_calls.count(4) >= 8
    monkeypatch.setattr(decoder_layer, "compiles", lambda layer: False)
    calls_before = len(layer_calls)
    general_out, compiled, _ = _run(path, kv_cache_dtype=kv_cache_dtype)
    assert compiled == 0 and len(layer_calls) == calls_before
    assert compiled_out == general_out


def test_a_step_the_compiled_layer_cannot_take_runs_the_general_forward(unpinned, layer_calls, tmp_path):
    """An fp8 KV cache: the compiled attention does not read it, so the layer keeps the general forward."""
    path = save_tiny_model("qwen3", tmp_path / "qwen3")
    outputs, compiled, _ = _run(path, kv_cache_dtype="fp8")
    assert compiled == 2 and not layer_calls
    assert all(len(tokens) == 7 for tokens, _ in outputs)
