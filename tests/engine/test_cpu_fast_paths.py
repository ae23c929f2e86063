"""The CPU's fast paths equal the references: attention over slots, packed and float16 linears, dtype choice."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from nanovllm import LLM, SamplingParams
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.reference import decode_attention_ref, prefill_attention_ref, store_kvcache_ref
from nanovllm.config import EngineConfig
from nanovllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.linear import QKVParallelLinear
from nanovllm.platforms.cpu import linear as cpu_linear
from nanovllm.platforms.cpu import settings as cpu_settings
from nanovllm.platforms.cpu.attention import (
    CpuAttentionBackend,
    decode_attention_cpu,
    decode_plan,
    prefill_attention_cpu,
)
from nanovllm.platforms.cpu.row_scale import RowScaled, normalize_rows
from nanovllm.platforms.cpu.sampler import greedy_tokens as cpu_greedy_tokens


def paged(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("num_heads, num_kv_heads, block_size", [(9, 3, 16), (4, 4, 1), (8, 2, 256), (6, 1, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_reference(num_heads, num_kv_heads, block_size, dtype):
    head_dim = 32
    seq_lens = torch.tensor([1, 7, 33, 0, 20, 300 if block_size == 256 else 60], dtype=torch.int32)
    width = (int(seq_lens.max()) + block_size - 1) // block_size
    num_blocks = len(seq_lens) * width + 3
    k_cache, v_cache = paged(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    tables = torch.randperm(num_blocks)[:len(seq_lens) * width].view(len(seq_lens), width).int()
    tables[3] = -1  # a padding request: no blocks, seq_len 0
    q = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype)
    ref = decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 0.3)
    out = decode_attention_cpu(q, k_cache, v_cache, decode_plan(tables, seq_lens, int(seq_lens.max()), block_size),
                               0.3)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, ref, **tol)
    assert torch.all(out[3] == 0)


@pytest.mark.parametrize("num_heads, num_kv_heads, block_size", [(9, 3, 16), (4, 4, 8), (4, 2, 256)])
def test_prefill_matches_reference(num_heads, num_kv_heads, block_size):
    head_dim, num_blocks = 16, 64
    k_cache, v_cache = paged(num_blocks, block_size, num_kv_heads, head_dim)
    # (context_len, query_len): fresh prompts, a chunk after a cached prefix, a one-token chunk
    shapes = [(0, 5), (19, 7), (0, 40), (33, 1)]
    seq_lens = [c + n for c, n in shapes]
    width = (max(seq_lens) + block_size - 1) // block_size
    tables = torch.randperm(num_blocks)[:len(shapes) * width].view(len(shapes), width).int()
    num_tokens = sum(n for _, n in shapes)
    q = torch.randn(num_tokens, num_heads, head_dim)
    k = torch.randn(num_tokens, num_kv_heads, head_dim)
    v = torch.randn(num_tokens, num_kv_heads, head_dim)
    slots = torch.cat([tables[i].long()[torch.arange(c, c + n) // block_size] * block_size
                       + torch.arange(c, c + n) % block_size for i, (c, n) in enumerate(shapes)])
    store_kvcache_ref(k, v, k_cache, v_cache, slots)
    cu = torch.tensor([0] + [n for _, n in shapes]).cumsum(0).int()
    ref = prefill_attention_ref(q, k_cache, v_cache, tables, cu, torch.tensor(seq_lens, dtype=torch.int32), 0.25)
    out = prefill_attention_cpu(q, k, v, k_cache, v_cache, tables, [n for _, n in shapes], seq_lens, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_backend_on_a_mixed_batch_matches_the_references():
    """Decodes first, then prefill chunks; the K/V store skips slots < 0 (the slow path) or not (index_copy_)."""
    block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 8
    for skip_one in (False, True):
        k_cache, v_cache = paged(32, block_size, num_kv_heads, head_dim)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        # two decodes (seq_len 6 and 9), then a chunk of 3 after 5 cached tokens, then a fresh prompt of 4
        query_lens, seq_lens = [1, 1, 3, 4], [6, 9, 8, 4]
        tables = torch.tensor([[0, 1, -1], [2, 3, 4], [5, 6, -1], [7, -1, -1]], dtype=torch.int32)
        positions = [5, 8, 5, 6, 7, 0, 1, 2, 3]
        owners = [0, 1, 2, 2, 2, 3, 3, 3, 3]
        slots = torch.tensor([int(tables[o, p // block_size]) * block_size + p % block_size
                              for o, p in zip(owners, positions)])
        if skip_one:
            slots[1] = -1
        q = torch.randn(9, num_heads, head_dim)
        k, v = torch.randn(9, num_kv_heads, head_dim), torch.randn(9, num_kv_heads, head_dim)
        meta = AttentionMetadata(slot_mapping=slots, cu_seqlens_q=torch.tensor([0, 1, 2, 5, 9], dtype=torch.int32),
                                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
                                 num_decodes=2, num_decode_tokens=2, max_query_len=4, max_seq_len=9,
                                 query_lens_host=query_lens, seq_lens_host=seq_lens)
        backend = CpuAttentionBackend()
        backend.prepare(meta, block_size)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.5)
        store_kvcache_ref(k, v, k_ref, v_ref, slots)
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
        ref_decode = decode_attention_ref(q[:2], k_ref, v_ref, tables[:2], meta.seq_lens[:2], 0.5)
        ref_prefill = prefill_attention_ref(q[2:], k_ref, v_ref, tables[2:], meta.cu_seqlens_q[2:] - 2,
                                            meta.seq_lens[2:], 0.5)
        if skip_one:  # the fresh prompt reads its own k/v, the references the cache: equal only where stored
            torch.testing.assert_close(out[:1], ref_decode[:1], atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(out, torch.cat([ref_decode, ref_prefill]), atol=1e-5, rtol=1e-5)


def test_backend_refuses_a_step_it_was_not_prepared_for():
    """The per-step plan belongs to one step's metadata: a forward for another step must not read it."""
    k_cache, v_cache = paged(4, 4, 1, 8)
    q, k = torch.randn(1, 2, 8), torch.randn(1, 1, 8)

    def decode_step() -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=torch.tensor([2]), cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
                                 seq_lens=torch.tensor([3], dtype=torch.int32),
                                 block_tables=torch.tensor([[0]], dtype=torch.int32), num_decodes=1,
                                 num_decode_tokens=1, max_query_len=1, max_seq_len=3, query_lens_host=[1],
                                 seq_lens_host=[3])

    backend, step, next_step = CpuAttentionBackend(), decode_step(), decode_step()
    with pytest.raises(RuntimeError, match="prepare"):
        backend.forward(q, k, k, k_cache, v_cache, step, 1.0)
    backend.prepare(step, 4)
    backend.forward(q, k, k, k_cache, v_cache, step, 1.0)
    backend.prepare(next_step, 4)
    with pytest.raises(RuntimeError, match="prepare"):
        backend.forward(q, k, k, k_cache, v_cache, step, 1.0)


def test_cpu_greedy_tokens_equal_torch_argmax():
    """The compiled argmax the CPU gives its sampler: ties to the lowest id; other dtypes and strided rows fall
    back to torch."""
    logits = torch.randn(5, 1000)
    logits[1, 17] = logits[1, 900] = 50.0
    logits[3] = 0.0  # all tied
    for x in (logits, logits.bfloat16(), logits[:, ::2]):
        assert torch.equal(cpu_greedy_tokens(x), x.argmax(dim=-1))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
def test_packed_linear_equals_f_linear_and_keeps_one_copy():
    torch.manual_seed(0)
    layer = QKVParallelLinear(64, 16, 4, 2, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    weight = layer.weight.detach().clone()
    x = torch.randn(5, 64)
    expected = F.linear(x, weight, layer.bias)
    cpu_linear.set_linear_method(layer, cpu_linear.linear_method(layer.weight, "packed"))
    assert layer.weight.numel() == 0, "the plain weight is released"
    for rows in (1, 5):
        torch.testing.assert_close(layer(x[:rows]), expected[:rows], atol=1e-5, rtol=1e-5)



@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
def test_tied_lm_head_keeps_the_embedding_weight(monkeypatch):
    model = torch.nn.Module()
    model.embed = VocabParallelEmbedding(100, 16)
    model.head = ParallelLMHead(100, 16)
    model.embed.weight.data.normal_()
    model.head.weight = model.embed.weight
    hidden = torch.randn(3, 16)
    expected = F.linear(hidden, model.embed.weight)
    assert cpu_linear.use_linear_methods(model, "packed") == 1
    assert model.embed.weight.numel() == 100 * 16
    torch.testing.assert_close(model.head(hidden), expected, atol=1e-5, rtol=1e-5)


def test_cpu_dtype_follows_native_bf16(monkeypatch):
    monkeypatch.delenv("NANOVLLM_CPU_DTYPE", raising=False)
    cpu_settings.cpu_has_fast_bf16.cache_clear()
    try:
        for native, dtype in ((True, torch.bfloat16), (False, torch.float32)):
            monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda n=native: n, raising=False)
            monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
            cpu_settings.cpu_has_fast_bf16.cache_clear()
            assert cpu_settings.default_cpu_dtype() == dtype
            monkeypatch.setattr(cpu_settings, "blocks_available", lambda: False)  # without the block kernels
            assert EngineConfig(device="cpu").torch_dtype == dtype
            assert EngineConfig(device="cpu", dtype="float32").torch_dtype == torch.float32
            # the int8 / float16 weight paths and the int8 KV cache compute in float32: asking for one picks it
            for option in ({"cpu_int8": True}, {"cpu_fp16": True}, {"kv_cache_dtype": "int8"}):
                config = EngineConfig(device="cpu", **option)
                assert config.torch_dtype == torch.float32, option
            assert EngineConfig(device="cpu", cpu_int8=True).kv_torch_dtype == torch.float16
        monkeypatch.setenv("NANOVLLM_CPU_DTYPE", "bfloat16")
        assert cpu_settings.default_cpu_dtype() == torch.bfloat16, "the variable decides over the CPU's features"
    finally:
        cpu_settings.cpu_has_fast_bf16.cache_clear()


def test_engine_with_fp16_weights_generates_like_float32(tiny_qwen3):
    """Greedy tokens with float16 weights stay those of float32 on a decisive model, alone and batched."""
    kwargs = dict(kvcache_block_size=16, num_kvcache_blocks=32, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [list(range(3, 30)), [7] * 5 + list(range(100, 140)), [300, 2, 45]]
    reference = LLM(tiny_qwen3, **kwargs)
    expected = [o.token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    llm = LLM(tiny_qwen3, cpu_fp16=True, **kwargs)
    layers = [m for m in llm.runner.model.modules() if hasattr(m, "linear_method")]
    assert layers and all(isinstance(m.linear_method, cpu_linear.Fp16Linear) for m in layers), "every linear and the LM head"
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.generate(prompts[:1], params, use_tqdm=False)[0].token_ids == expected[0]


def test_engine_in_bfloat16_generates_like_float32(tiny_qwen3):
    """A bfloat16 model on the CPU (what dtype auto picks where the CPU has native bf16 matmuls) keeps float32's
    greedy tokens on a decisive model, alone and batched, with its KV cache in bfloat16."""
    kwargs = dict(kvcache_block_size=16, num_kvcache_blocks=32, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [list(range(3, 30)), [7] * 5 + list(range(100, 140)), [300, 2, 45]]
    expected = [o.token_ids for o in LLM(tiny_qwen3, dtype="float32", **kwargs).generate(prompts, params,
                                                                                        use_tqdm=False)]
    llm = LLM(tiny_qwen3, dtype="bfloat16", **kwargs)
    assert llm.runner.kv_cache.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in llm.runner.model.parameters() if p.is_floating_point())
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.generate(prompts[:1], params, use_tqdm=False)[0].token_ids == expected[0]


def test_cpu_fp16_decode_is_a_deprecated_alias():
    with pytest.warns(DeprecationWarning, match="cpu_fp16"):
        config = EngineConfig(device="cpu", cpu_fp16_decode=True)
    assert config.cpu_fp16


@pytest.mark.parametrize("path, bound", [("int8", 0.03), ("fp16", 2e-3)])
def test_quantized_linear_tracks_float32_and_keeps_one_copy(path, bound):
    """int8: ~2 % of the largest output; float16 weights: ~2e-4. Both release the float32 weight."""
    torch.manual_seed(0)
    layer = QKVParallelLinear(64, 16, 4, 2, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(70, 64)
    expected = F.linear(x, layer.weight.detach().clone(), layer.bias)
    cpu_linear.set_linear_method(layer, cpu_linear.linear_method(layer.weight, path))
    assert layer.weight.numel() == 0
    assert type(layer.linear_method) is {"int8": cpu_linear.Int8Linear, "fp16": cpu_linear.Fp16Linear}[path]
    for rows in (1, 2, 5, 70):
        got, want = layer(x[:rows]), expected[:rows]
        assert got.dtype == torch.float32 and got.shape == want.shape
        error = (got - want).abs().max() / want.abs().max()
        assert error < bound, f"{rows} rows: {path} error {error:.2e} of the largest output"
    assert (layer(x) - expected).abs().max() > 0, f"the {path} path ran (it is not exact)"


def test_int8_tiles_replace_fbgemms_copy_and_keep_the_few_row_kernels_numbers(monkeypatch):
    """Where the compiled tiles are wanted, an int8 layer keeps them and the few-row kernel's copy (no fbgemm copy,
    no float32 weight); every row count gives the few-row kernel's product, row by row, RowScaled input too."""
    from nanovllm.platforms.cpu import cpu_ops

    torch.manual_seed(0)
    layer = QKVParallelLinear(64, 16, 4, 2, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(70, 64)
    weight = layer.weight.detach().clone()
    expected = F.linear(x, weight, layer.bias)
    per_row = torch.cat([cpu_ops.linear_i8(x[r:r + 1], cpu_ops.quantize_weight_int8(weight), layer.bias)
                         for r in range(70)])
    cpu_linear.set_linear_method(layer, cpu_linear.linear_method(layer.weight, "int8", int8_tiles=True))
    method = layer.linear_method
    assert method.tiles is not None and method.rows is not None
    assert method.packed is None and layer.weight.numel() == 0
    for rows in (1, 2, 3, 70):
        got = layer(x[:rows])
        torch.testing.assert_close(got, per_row[:rows], rtol=1e-5, atol=1e-5)
        assert (got - expected[:rows]).abs().max() < 0.03 * expected[:rows].abs().max()
    scaled = RowScaled(*normalize_rows(x))
    torch.testing.assert_close(layer(scaled), per_row, rtol=1e-5, atol=1e-5)


def test_int8_scales_each_row_so_an_outsized_row_leaves_the_others_alone():
    """A token with activations 1000x the others' (a prompt's first often has them) must not coarsen the rest: one
    scale for the whole step would leave the other rows ~8 levels of int8 and errors of tens of percent."""
    torch.manual_seed(1)
    layer = QKVParallelLinear(64, 16, 4, 2)
    layer.weight.data.normal_()
    x = torch.randn(8, 64)
    x[3] *= 1000
    expected = F.linear(x, layer.weight.detach().clone())
    cpu_linear.set_linear_method(layer, cpu_linear.linear_method(layer.weight, "int8"))
    got = layer(x)
    for row in range(8):
        error = (got[row] - expected[row]).abs().max() / expected[row].abs().max()
        assert error < 0.03, f"row {row}: int8 error {error:.2e} of its largest output"


def test_engine_with_int8_linears_tracks_float32(tiny_qwen3):
    """int8 in every linear layer and the LM head; the prompt's next-token logits stay near float32's."""
    kwargs = dict(kvcache_block_size=16, num_kvcache_blocks=32, dtype="float32")
    prompts = [list(range(3, 30)), [7] * 5 + list(range(100, 140)), [300, 2, 45]]
    logits = {}
    for int8 in (False, True):
        llm = LLM(tiny_qwen3, cpu_int8=int8, **kwargs)
        captured = []
        original = llm.runner.model.compute_logits
        llm.runner.model.compute_logits = lambda h, o=original, c=captured: c.append(o(h)) or c[-1]
        for prompt in prompts:
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        logits[int8] = torch.cat(captured)
        if int8:
            layers = {name: m for name, m in llm.runner.model.named_modules() if hasattr(m, "linear_method")}
            assert layers and all(isinstance(m.linear_method, cpu_linear.Int8Linear) for m in layers.values()), \
                "every linear, down_proj included, multiplies in int8"
    ref, got = logits[False], logits[True]
    spread = (ref.max(-1).values - ref.min(-1).values).min()
    assert (got - ref).abs().max() < 0.1 * spread
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("compiled", [True, False])  # False: the torch ops, which apply a RowScaled's scale first
def test_int8_row_scales_handed_between_ops_give_the_same_logits(tiny_qwen3, monkeypatch, compiled):
    """Under cpu_int8 the norms and the activation write their rows normalized for the int8 linears, and o_proj,
    gate_up_proj and down_proj leave their row scale to the op after them (platforms/cpu/row_scale.RowScaled): the logits are
    those of applying every scale at the linear, bit for bit (the same roundings in the same order)."""
    from nanovllm.platforms.cpu import cpu_ops

    if not compiled:
        monkeypatch.setattr(cpu_ops, "load", lambda: None)
    llm = LLM(tiny_qwen3, cpu_int8=True, kvcache_block_size=16, num_kvcache_blocks=32, dtype="float32",
              enable_prefix_caching=False)
    model = llm.runner.model
    layers = model.model.layers
    handed = {"in": 0, "out": 0}
    original_linear = cpu_linear.int8_linear

    def spy(x, packed, bias, keep_row_scale=False):
        y = original_linear(x, packed, bias, keep_row_scale)
        handed["in"] += isinstance(x, RowScaled)
        handed["out"] += isinstance(y, RowScaled)
        return y

    monkeypatch.setattr(cpu_linear, "int8_linear", spy)
    prompts = [list(range(3, 30)), [7] * 5 + list(range(100, 140)), [300, 2, 45]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)  # 3 rows a decode step: fbgemm

    def logits():
        captured = []
        original = model.compute_logits
        model.compute_logits = lambda h: captured.append(original(h)) or captured[-1]
        llm.generate(prompts, params, use_tqdm=False)
        model.compute_logits = original
        return torch.cat(captured)

    handed_on = logits()
    # 4 steps x 2 layers: qkv, gate_up and down read normalized rows (written so by the compiled ops only); o,
    # gate_up and down hand theirs on
    assert handed == {"in": 4 * 2 * 3 if compiled else 0, "out": 4 * 2 * 3}
    for layer in layers:
        layer.input_layernorm.emits_row_scaled = layer.post_attention_layernorm.emits_row_scaled = False
        layer.mlp.act.emits_row_scaled = False
        for linear in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            linear.linear_method.keeps_row_scale = False
    handed.update({"in": 0, "out": 0})
    applied_at_the_linear = logits()
    assert handed == {"in": 0, "out": 0}
    assert torch.equal(handed_on, applied_at_the_linear), "the same roundings in the same order"


def test_row_scaled_input_reaches_every_linear_path():
    """A RowScaled input (normalized rows + their scales) gives the plain input's product on int8's few-row kernel,
    fbgemm, the tiles and the 4/8-bit blocks."""
    torch.manual_seed(2)
    x = torch.randn(6, 64)
    scaled = RowScaled(*normalize_rows(x))
    for kind, option in (("int8", "fbgemm only"), ("int8", None), ("int8", "tiles"), ("blocks", None)):
        layer = QKVParallelLinear(64, 16, 4, 2)
        layer.weight.data.normal_()
        cpu_linear.set_linear_method(layer, cpu_linear.linear_method(layer.weight, kind, int8_tiles=option == "tiles"))
        if option == "fbgemm only":
            layer.linear_method.rows = None
        for rows in (1, 6):
            part = RowScaled(scaled.values[:rows], scaled.scale[:rows])
            torch.testing.assert_close(layer(part), layer(x[:rows]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("flag", ["cpu_int8", "cpu_fp16"])
def test_cpu_weight_formats_warn_where_they_do_not_apply(flag):
    with pytest.warns(UserWarning, match=f"{flag} applies to float32 models on the CPU only.*bfloat16"):
        EngineConfig(device="cpu", dtype="bfloat16", **{flag: True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EngineConfig(device="cpu", dtype="float32", **{flag: True})  # where it applies: no warning
