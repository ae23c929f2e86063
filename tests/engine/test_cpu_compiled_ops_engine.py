"""The engine on the CPU runs its steps through the compiled ops (platforms/cpu/cpu_ops.py) and still gives
transformers' greedy tokens; under cpu_int8, steps of one or two rows take the int8 matrix-vector kernel."""

from __future__ import annotations

import pytest
import torch

from nanovllm.platforms.cpu import cpu_ops
from tests.helpers import hf_greedy, save_tiny_model


@pytest.fixture
def op_calls(monkeypatch) -> dict[str, list[int]]:
    """Spy on the compiled ops: the row count of every call, by op."""
    calls: dict[str, list[int]] = {}
    for name in ("rope_store_attention", "add_rms_norm", "silu_and_mul", "linear_i8", "linear_i8_tiles",
                 "argmax_rows"):
        original = getattr(cpu_ops, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls.setdefault(_name, []).append(args[0].shape[0])
            return _original(*args, **kwargs)

        monkeypatch.setattr(cpu_ops, name, spy)
    return calls


@pytest.mark.parametrize("compiled", [True, False])  # False: no C compiler, or NANOVLLM_CPU_KERNELS=0
@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: the kernel's q/k norms
def test_steps_give_hf_tokens_with_and_without_the_compiled_ops(family, compiled, tmp_path, monkeypatch,
                                                                op_calls):
    from nanovllm import LLM, SamplingParams
    from nanovllm.platforms.cpu import attention as cpu_attention

    if not compiled:
        monkeypatch.setattr(cpu_ops, "load", lambda: None)
    decode_plans = []  # the torch path's slots of the decodes: planned once per step, shared by the layers
    plan = cpu_attention.decode_plan
    monkeypatch.setattr(cpu_attention, "decode_plan", lambda *args: decode_plans.append(1) or plan(*args))
    path = save_tiny_model(family, tmp_path / family)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (1, 9, 30)]
    prompts.append(prompts[2][:20] + [5, 6, 7])  # shares its first block with the prompt before it, in one step
    reference, _ = hf_greedy(path, prompts, 6)
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=64)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == reference
    assert llm.scheduler.block_manager.num_hit_tokens == 16
    if not compiled:
        assert not op_calls  # the same steps as torch ops
        assert len(decode_plans) == 6  # every step has decodes (the 1-token prompt is one in the first)
        return
    # the prompts prefill in one step (40 rows, and 7 of the last prompt's 23), then 5 decode steps with every
    # request in each; 2 layers
    assert op_calls["rope_store_attention"] == [47] * 2 + [4] * 10
    assert not decode_plans
    assert op_calls["argmax_rows"] == [4] * 6  # the CPU's greedy tokens, given to the sampler at load
    assert 4 in op_calls["add_rms_norm"] and 4 in op_calls["silu_and_mul"]
    assert "linear_i8" not in op_calls  # float32 model, no cpu_int8


def test_cpu_int8_takes_the_int8_kernel_for_one_or_two_rows(tmp_path, op_calls):
    from nanovllm import LLM, SamplingParams

    path = save_tiny_model("llama", tmp_path / "llama")
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=64, cpu_int8=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]["token_ids"]
    # qkv, o, gate_up, down per layer and the LM head: one row each decode step
    assert op_calls["linear_i8"] and set(op_calls["linear_i8"]) == {1}
    op_calls.clear()
    llm.generate([[5, 6, 7]] * 3, params, use_tqdm=False)
    assert "linear_i8" not in op_calls  # three rows: torch's int8 GEMM
    assert len(alone) == 4 and all(0 <= t < 384 for t in alone)


def test_cpu_int8_tiles_take_steps_of_three_rows_or_more(tmp_path, op_calls, monkeypatch):
    """With the compiled tiles (the default on AVX512-VNNI CPUs) steps of 3+ rows multiply there, a row or two in
    the few-row kernel, with the same quantization: a request's tokens do not depend on what shares its steps."""
    from nanovllm import LLM, SamplingParams

    monkeypatch.setenv("NANOVLLM_CPU_INT8_TILES", "1")
    path = save_tiny_model("llama", tmp_path / "llama")
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=64, cpu_int8=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [5, 6, 7, 300, 41]
    alone = llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
    # a prefill of 5 rows, then decode steps of one: 2 layers x (qkv, o, gate_up, down) + the LM head's last row
    assert op_calls["linear_i8_tiles"] == [5] * 8 and set(op_calls["linear_i8"]) == {1}
    op_calls.clear()
    together = llm.generate([prompt, [9, 8, 7, 6, 5, 4, 3], [100, 200]], params, use_tqdm=False)
    assert "linear_i8" not in op_calls and set(op_calls["linear_i8_tiles"]) >= {3, 14}
    assert together[0]["token_ids"] == alone


def test_a_float16_kv_cache_gives_the_torch_paths_tokens(tmp_path, op_calls):
    """kv_cache_dtype=float16: the compiled decode reads and writes the float16 cache as the torch ops do."""
    from nanovllm import LLM, SamplingParams

    path = save_tiny_model("qwen3", tmp_path / "qwen3")
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (2, 11, 25)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=64, kv_cache_dtype="float16")
    assert llm.runner.kv_cache.dtype == torch.float16
    compiled = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert op_calls["rope_store_attention"]
    op_calls.clear()
    original = cpu_ops.kv_cache_usable
    try:
        cpu_ops.kv_cache_usable = lambda k_cache: False  # the torch ops on the same cache
        fallback = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        cpu_ops.kv_cache_usable = original
    assert "rope_store_attention" not in op_calls
    assert compiled == fallback


def test_kv_cache_dtype_defaults_and_errors():
    from nanovllm.config import EngineConfig

    assert EngineConfig(device="cpu", dtype="float32").kv_torch_dtype == torch.float32
    # cpu_int8's rounding is far coarser than a float16 cache's: auto takes the faster, smaller cache there
    assert EngineConfig(device="cpu", dtype="float32", cpu_int8=True).kv_torch_dtype == torch.float16
    assert EngineConfig(device="cpu", dtype="float32", cpu_int8=True, kv_cache_dtype="float32").kv_torch_dtype == \
        torch.float32
    assert EngineConfig(device="cpu", dtype="float32", kv_cache_dtype="float16").kv_torch_dtype == torch.float16
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or one of"):
        EngineConfig(device="cpu", kv_cache_dtype="fp8_e5m2")  # e4m3 only
    assert EngineConfig(device="cpu", dtype="float32", kv_cache_dtype="int8").kv_torch_dtype == torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' needs a float32 model.*bfloat16"):
        EngineConfig(device="cpu", dtype="bfloat16", kv_cache_dtype="int8")


def test_an_int8_kv_cache_needs_the_compiled_attention(tmp_path, monkeypatch):
    """Only the compiled kernel reads int8 rows and their scales: without it the engine refuses at start, and
    the torch attention refuses such a cache rather than read its bytes as values."""
    from nanovllm import LLM
    from nanovllm.platforms.cpu.attention import CpuAttentionBackend

    path = save_tiny_model("llama", tmp_path / "llama")
    monkeypatch.setattr(cpu_ops, "load", lambda: None)
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is read by the compiled CPU ops only"):
        LLM(path, num_kvcache_blocks=8, max_model_len=64, kv_cache_dtype="int8")
    q, k = torch.randn(1, 2, 8), torch.randn(1, 1, 8)
    cache = torch.zeros(4, 16, 1, 12, dtype=torch.int8)
    with pytest.raises(ValueError, match="needs the compiled CPU attention"):
        CpuAttentionBackend().forward(q, k, k, cache, cache, None, 1.0)


def test_a_failed_build_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setenv("NANOVLLM_CACHE_DIR", str(tmp_path))
    cpu_ops.load.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert cpu_ops.load() is None
        assert "building the CPU decode ops failed" in caplog.text
        assert not cpu_ops.usable(torch.zeros(1))
        assert not list(tmp_path.rglob("*.so"))  # no half-written library left behind
    finally:
        cpu_ops.load.cache_clear()
    monkeypatch.setenv("NANOVLLM_CPU_KERNELS", "0")
    try:
        assert cpu_ops.load() is None
    finally:
        cpu_ops.load.cache_clear()


def test_the_cpu_block_size_lets_a_chat_system_prompt_hit_the_prefix_cache(tmp_path):
    """CPU default of 16 tokens a block (256 on CUDA): two prompts sharing a 20-token prefix share a block."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.config import EngineConfig

    assert EngineConfig(device="cpu").kvcache_block_size == 16
    assert EngineConfig(device="cpu", kvcache_block_size=64).kvcache_block_size == 64
    llm = LLM(save_tiny_model("llama", tmp_path / "llama"), num_kvcache_blocks=64, max_model_len=128)
    prefix = list(range(3, 23))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([prefix + [30, 31]], params, use_tqdm=False)
    second = llm.generate([prefix + [40, 41, 42]], params, use_tqdm=False)[0]
    assert second["num_cached_tokens"] == 16
