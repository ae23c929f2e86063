"""The CPU's default with no flags: linear layers on 4/8-bit weight blocks (platforms/cpu/linear.BlockLinear),
chosen once from the config; float32 stays one argument away and is what the exactness tests use."""

from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.config import EngineConfig
from nanovllm.layers.linear_method import UNQUANTIZED
from nanovllm.platforms.cpu import settings as cpu_settings
from nanovllm.platforms.cpu.linear import BlockLinear


@pytest.fixture
def unpinned(monkeypatch):
    """The environment of a user: the suite's NANOVLLM_CPU_DTYPE=float32 unset."""
    monkeypatch.delenv("NANOVLLM_CPU_DTYPE", raising=False)


def test_the_default_is_blocks_and_float32_one_argument_away(unpinned, monkeypatch) -> None:
    config = EngineConfig(device="cpu")
    assert config.cpu.blocks, "this machine's compiled ops have AVX2 or AVX512-VNNI"
    assert (config.cpu_linear, config.torch_dtype, config.kv_torch_dtype) == ("blocks", torch.float32, torch.float16)
    for explicit in ({"dtype": "float32"}, {"dtype": "bfloat16"}, {"cpu_int8": True}, {"cpu_fp16": True}):
        assert EngineConfig(device="cpu", **explicit).cpu_linear != "blocks", explicit
    assert EngineConfig(device="cpu", dtype="float32").kv_torch_dtype == torch.float32
    assert config.cpu.block_passes is None  # by each layer's role (linear.BLOCK_PASSES_BY_ROLE)
    for forced in (1, 2):
        monkeypatch.setenv("NANOVLLM_CPU_BLOCK_PASSES", str(forced))
        assert EngineConfig(device="cpu").cpu.block_passes == forced
    monkeypatch.setenv("NANOVLLM_CPU_BLOCK_PASSES", "3")
    with pytest.raises(ValueError, match=r"NANOVLLM_CPU_BLOCK_PASSES must be 1 or 2 \(or unset: by role\), got '3'"):
        EngineConfig(device="cpu")
    monkeypatch.delenv("NANOVLLM_CPU_BLOCK_PASSES")
    monkeypatch.setenv("NANOVLLM_CPU_DTYPE", "float32")  # read once, when an engine is configured
    assert EngineConfig(device="cpu").cpu_linear == "float"
    monkeypatch.delenv("NANOVLLM_CPU_DTYPE")
    monkeypatch.setattr(cpu_settings, "blocks_available", lambda: False)  # no compiler, or no SIMD
    assert EngineConfig(device="cpu").cpu_linear in ("float", "packed")


def test_an_engine_on_blocks_generates_like_float32(unpinned, tiny_qwen3) -> None:
    """A safetensors model (float weights) gets 8-bit blocks in every linear and the LM head; its greedy tokens are
    float32's on a decisive model, alone and batched."""
    kwargs = dict(kvcache_block_size=16, num_kvcache_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [list(range(3, 30)), [7] * 5 + list(range(100, 140)), [300, 2, 45]]
    reference = LLM(tiny_qwen3, dtype="float32", **kwargs)
    assert all(m.linear_method is UNQUANTIZED for m in reference.runner.model.modules() if hasattr(m, "linear_method"))
    expected = [o.token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    llm = LLM(tiny_qwen3, **kwargs)
    layers = [m for m in llm.runner.model.modules() if hasattr(m, "linear_method")]
    assert layers and all(isinstance(m.linear_method, BlockLinear) and m.linear_method.weight.bits == 8
                          for m in layers), "every linear and the LM head"
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.generate(prompts[:1], params, use_tqdm=False)[0].token_ids == expected[0]


def test_each_layer_takes_its_roles_passes_unless_the_environment_sets_one_for_all(unpinned, tiny_qwen3,
                                                                                    monkeypatch) -> None:
    """By default one pass in the MLP's gate/up projection, the LM head one pass with its near-top outputs in two,
    two passes elsewhere (linear.BLOCK_PASSES_BY_ROLE); NANOVLLM_CPU_BLOCK_PASSES=1 or 2 for every layer alike."""
    kwargs = dict(kvcache_block_size=16, num_kvcache_blocks=32)

    def passes(llm) -> dict[str, set]:
        found: dict[str, set] = {}
        for name, module in llm.runner.model.named_modules():
            method = getattr(module, "linear_method", None)
            if isinstance(method, BlockLinear):
                found.setdefault(name.rpartition(".")[2], set()).add((method.passes, method.refine_top))
        return found

    llm = LLM(tiny_qwen3, **kwargs)
    assert passes(llm) == {"qkv_proj": {(2, False)}, "o_proj": {(2, False)}, "gate_up_proj": {(1, False)},
                           "down_proj": {(2, False)}, "lm_head": {(1, True)}}
    llm.close()
    for forced in (1, 2):
        monkeypatch.setenv("NANOVLLM_CPU_BLOCK_PASSES", str(forced))
        llm = LLM(tiny_qwen3, **kwargs)
        assert set().union(*passes(llm).values()) == {(forced, False)}
        llm.close()
