"""The CPU's compiled ops (platforms/cpu/cpu_ops.c) against their torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.reference import decode_attention_ref, prefill_attention_ref, store_kvcache_ref
from nanovllm.platforms.cpu import cpu_ops
from nanovllm.platforms.cpu.attention import token_rows

if cpu_ops.load() is None:  # the suite's machines have a C compiler; say so loudly if one does not
    pytest.fail("the CPU decode ops did not build (no C compiler, or NANOVLLM_CPU_KERNELS=0)", pytrace=False)


def _rotate_ref(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@pytest.mark.parametrize("rows,dim", [(1, 576), (3, 64), (40, 2048)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(rows, dim, with_residual) -> None:
    torch.manual_seed(0)
    x, residual, weight = torch.randn(rows, dim) * 3, torch.randn(rows, dim), torch.rand(dim) + 0.5
    if with_residual:
        out, summed = cpu_ops.add_rms_norm(x, weight, 1e-5, residual)
        torch.testing.assert_close(summed, x + residual, rtol=0, atol=0)
        ref = F.rms_norm(x + residual, (dim,), weight, 1e-5)
    else:
        out = cpu_ops.add_rms_norm(x, weight, 1e-5)
        ref = F.rms_norm(x, (dim,), weight, 1e-5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def _normalized_ref(out):
    row_max = out.abs().amax(1, keepdim=True)
    row_max = torch.where(row_max > 0, row_max, torch.ones_like(row_max))
    return out / row_max, row_max


@pytest.mark.parametrize("rows,dim", [(1, 576), (3, 37), (64, 1536)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_with_row_scales_in_and_out(rows, dim, with_residual) -> None:
    """x's rows scaled on the way in (an int8 linear's product), the output normalized for the next one."""
    torch.manual_seed(5)
    x, residual, weight = torch.randn(rows, dim), torch.randn(rows, dim), torch.rand(dim) + 0.5
    x_scale = torch.logspace(-2, 2, rows)[:, None]
    if with_residual:
        (out, out_max), summed = cpu_ops.add_rms_norm(x, weight, 1e-5, residual, x_scale, normalize_out=True)
        torch.testing.assert_close(summed, x * x_scale + residual, rtol=1e-6, atol=1e-6)
        ref = F.rms_norm(x * x_scale + residual, (dim,), weight, 1e-5)
    else:
        out, out_max = cpu_ops.add_rms_norm(x, weight, 1e-5, normalize_out=True)
        ref = F.rms_norm(x, (dim,), weight, 1e-5)
    ref_out, ref_max = _normalized_ref(ref)
    torch.testing.assert_close(out_max, ref_max, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out * out_max, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,dim", [(1, 576), (3, 37), (64, 1536)])
def test_normalize_rows_matches_torch(rows, dim) -> None:
    torch.manual_seed(4)
    x = torch.randn(rows, dim) * torch.logspace(-3, 3, rows)[:, None]
    x[0] = 0.0  # a row of zeros keeps its zeros, with a scale of 1
    out, scales = cpu_ops.normalize_rows(x)
    row_max = x.abs().amax(1, keepdim=True)
    torch.testing.assert_close(scales, torch.where(row_max > 0, row_max, torch.ones_like(row_max)), rtol=0, atol=0)
    torch.testing.assert_close(out, x / scales, rtol=1e-6, atol=0)
    assert out.abs().amax().item() <= 1.0 + 1e-6


@pytest.mark.parametrize("rows,half", [(1, 1536), (5, 100), (64, 1536)])
def test_silu_and_mul_matches_torch(rows, half) -> None:
    torch.manual_seed(1)
    gate_up = torch.randn(rows, 2 * half) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_and_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,half", [(1, 1536), (5, 100), (64, 1536)])
def test_silu_and_mul_with_row_scales_in_and_out(rows, half) -> None:
    torch.manual_seed(6)
    gate_up, in_scale = torch.randn(rows, 2 * half), torch.logspace(-1, 1, rows)[:, None]
    out, out_max = cpu_ops.silu_and_mul(gate_up, in_scale, normalize_out=True)
    gate, up = (gate_up * in_scale).chunk(2, dim=-1)
    ref_out, ref_max = _normalized_ref(F.silu(gate) * up)
    torch.testing.assert_close(out_max, ref_max, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,cols", [(1, 49152), (3, 37), (64, 1000)])
def test_argmax_rows_matches_torch(rows, cols) -> None:
    torch.manual_seed(7)
    x = torch.randn(rows, cols + 5)[:, :cols]  # rows apart by more than their length
    torch.testing.assert_close(cpu_ops.argmax_rows(x), x.argmax(-1), rtol=0, atol=0)
    if rows < 3:
        return
    x[0, :] = float("-inf")  # every token banned: the first
    x[1, cols // 2] = x[1, cols - 1] = x[1].max() + 1  # equal maxima: the first of them
    x[2, cols // 3] = x[2, cols - 1] = float("nan")  # NaNs win, as in torch: the first of them
    torch.testing.assert_close(cpu_ops.argmax_rows(x), x.argmax(-1), rtol=0, atol=0)


def _rope_store_ref(qkv, positions, cos, sin, q_norm, k_norm, k_cache, v_cache, slots, num_heads):
    """The torch reference of the kernel's first half: q/k norm and RoPE of every row, K/V stored into copies of
    the caches. Returns (q [rows, num_heads, head_dim], k_cache copy, v_cache copy)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    rows = qkv.shape[0]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k = q.reshape(rows, num_heads, head_dim), k.reshape(rows, num_kv_heads, head_dim)
    if q_norm is not None:
        q, k = F.rms_norm(q, (head_dim,), q_norm, 1e-6), F.rms_norm(k, (head_dim,), k_norm, 1e-6)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q, k = _rotate_ref(q, c, s), _rotate_ref(k, c, s)
    store_kvcache_ref(k, v.reshape(rows, num_kv_heads, head_dim), k_ref, v_ref, slots)
    return q, k_ref, v_ref


def _random_caches(num_blocks, block_size, num_kv_heads, head_dim, kv_dtype):
    k, v = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim) for _ in range(2))
    if kv_dtype == torch.int8:
        return cpu_ops.int8_kv_rows(k), cpu_ops.int8_kv_rows(v)
    return k.to(kv_dtype), v.to(kv_dtype)


def _readable(cache):
    """A cache as float values the torch references read (the int8 cache's rows scaled back)."""
    return cpu_ops.float_kv_rows(cache) if cache.dtype == torch.int8 else cache


def _check_stored(k_cache, v_cache, k_ref, v_ref):
    """The kernel's K/V against the reference's: float32 exact up to rounding, float16 to its neighbour where the
    two rotations differ in float32, int8 within half a step of its row (step = the row's largest magnitude
    / 127; rows the kernel did not write are untouched)."""
    if k_cache.dtype == torch.int8:
        for cache, ref in ((k_cache, k_ref), (v_cache, v_ref)):
            half_step = ref.abs().amax(-1, keepdim=True) / 254
            assert ((cpu_ops.float_kv_rows(cache) - ref).abs() <= half_step * 1.001 + 1e-6).all()
        return
    tol = 1e-5 if k_cache.dtype == torch.float32 else 1e-3
    torch.testing.assert_close(k_cache, k_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0)


def _attention_tolerance(kv_dtype):
    # int8: the reference reads the very values the kernel stored, so only float rounding is left
    return {"rtol": 1e-4, "atol": 1e-5} if kv_dtype != torch.float16 else {"rtol": 1e-3, "atol": 1e-3}


@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 16)])
def test_int8_kv_rows_round_to_half_a_step_and_keep_zeros(shape) -> None:
    torch.manual_seed(4)
    x = torch.randn(*shape) * 3
    x[0] = 0.0
    rows = cpu_ops.int8_kv_rows(x)
    assert rows.dtype == torch.int8 and rows.shape[-1] == cpu_ops.kv_cache_row_width(torch.int8, shape[-1])
    back = cpu_ops.float_kv_rows(rows)
    assert torch.equal(back[0], torch.zeros_like(back[0]))
    assert ((back - x).abs() <= x.abs().amax(-1, keepdim=True) / 254 * 1.001).all()
    assert rows[..., :-4].abs().amax(-1)[1:].eq(127).all()  # each row's largest magnitude is a full step count


# (num_heads, num_kv_heads, head_dim, block_size, q/k norm): SmolLM2's 9/3 x 64, MHA, GQA 8, Qwen3-style norms
CASES = [(9, 3, 64, 256, False), (4, 4, 32, 16, False), (8, 1, 128, 16, True), (6, 2, 16, 4, True)]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("copies", [1, 4])  # 5 requests: a task per KV head; 20: a task per request
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,qk_norm", CASES)
def test_rope_store_attention_of_decodes_matches_reference(num_heads, num_kv_heads, head_dim, block_size,
                                                       qk_norm, copies, kv_dtype) -> None:
    torch.manual_seed(2)
    # one token, block boundaries, ragged
    seq_lens = [1, block_size, block_size + 1, 3 * block_size + 5, 40] * copies
    num_seqs, max_blocks = len(seq_lens), max(-(-n // block_size) for n in seq_lens) + 1
    num_blocks = num_seqs * max_blocks + 3
    k_cache, v_cache = _random_caches(num_blocks, block_size, num_kv_heads, head_dim, kv_dtype)
    # scattered, non-consecutive blocks per request; unused table entries hold -1
    order = torch.randperm(num_blocks)[:num_seqs * max_blocks].view(num_seqs, max_blocks).int()
    tables = torch.full((num_seqs, max_blocks + 2), -1, dtype=torch.int32)
    for i, n in enumerate(seq_lens):
        used = -(-n // block_size)
        tables[i, :used] = order[i, :used]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    positions = lens.long() - 1
    slots = tables[torch.arange(num_seqs), positions // block_size].long() * block_size + positions % block_size
    slots[2] = -1  # a padding row: nothing stored, still attends over what is cached
    max_position = 4 * block_size + 64
    angles = torch.outer(torch.arange(max_position).float(), torch.rand(head_dim // 2) + 0.01)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    q_norm = torch.rand(head_dim) + 0.5 if qk_norm else None
    k_norm = torch.rand(head_dim) + 0.5 if qk_norm else None
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_seqs, width + 7)[:, :width]  # rows with a stride past their width
    scale = head_dim ** -0.5

    q, k_ref, v_ref = _rope_store_ref(qkv, positions, cos, sin, q_norm, k_norm, _readable(k_cache),
                                      _readable(v_cache), slots, num_heads)

    out = cpu_ops.rope_store_attention(qkv, positions, cos, sin, q_norm, k_norm, 1e-6, k_cache, v_cache, tables,
                                       lens, slots, num_heads, num_kv_heads, scale)
    _check_stored(k_cache, v_cache, k_ref, v_ref)
    ref = decode_attention_ref(q, _readable(k_cache), _readable(v_cache), tables, lens, scale)
    torch.testing.assert_close(out, ref, **_attention_tolerance(kv_dtype))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("copies", [1, 3])  # few rows: a task per KV head of a row; many: a task per row
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,qk_norm", CASES)
def test_rope_store_attention_of_a_mixed_step_matches_reference(num_heads, num_kv_heads, head_dim, block_size,
                                                                qk_norm, copies, kv_dtype) -> None:
    """Decodes, then prefill chunks (a whole prompt; a chunk after cached context across blocks; one token after
    context): every row's K/V is stored before any row attends, each row sees its request's tokens up to itself."""
    torch.manual_seed(3)
    decode_lens = [5, block_size + 1] * copies
    chunks = [(0, 7), (block_size + 3, block_size + 2), (2 * block_size, 1)] * copies  # (context, query) lengths
    query_lens = [1] * len(decode_lens) + [q for _, q in chunks]
    seq_lens = decode_lens + [c + q for c, q in chunks]
    num_seqs, max_blocks = len(seq_lens), max(-(-n // block_size) for n in seq_lens)
    num_blocks = num_seqs * max_blocks + 2
    k_cache, v_cache = _random_caches(num_blocks, block_size, num_kv_heads, head_dim, kv_dtype)
    tables = torch.randperm(num_blocks)[:num_seqs * max_blocks].view(num_seqs, max_blocks).int()
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(seq_lens, query_lens)])
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), torch.tensor(query_lens))
    slots = tables[seq_of_token, positions // block_size].long() * block_size + positions % block_size
    num_tokens = len(positions)
    angles = torch.outer(torch.arange(4 * block_size + 64).float(), torch.rand(head_dim // 2) + 0.01)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    q_norm = torch.rand(head_dim) + 0.5 if qk_norm else None
    k_norm = torch.rand(head_dim) + 0.5 if qk_norm else None
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    scale = head_dim ** -0.5
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(slots, cu, torch.tensor(seq_lens, dtype=torch.int32), tables, len(decode_lens),
                             len(decode_lens), max(query_lens), max(seq_lens), query_lens, seq_lens)

    q, k_ref, v_ref = _rope_store_ref(qkv, positions, cos, sin, q_norm, k_norm, _readable(k_cache),
                                      _readable(v_cache), slots, num_heads)

    row_seq, attend_lens = token_rows(meta)
    assert torch.equal(row_seq.long(), seq_of_token) and torch.equal(attend_lens.long(), positions + 1)
    out = cpu_ops.rope_store_attention(qkv, positions, cos, sin, q_norm, k_norm, 1e-6, k_cache, v_cache, tables,
                                       attend_lens, slots, num_heads, num_kv_heads, scale, row_seq)
    _check_stored(k_cache, v_cache, k_ref, v_ref)
    nd, k_read, v_read = len(decode_lens), _readable(k_cache), _readable(v_cache)
    ref = torch.cat([decode_attention_ref(q[:nd], k_read, v_read, tables[:nd], meta.seq_lens[:nd], scale),
                     prefill_attention_ref(q[nd:], k_read, v_read, tables[nd:], cu[nd:] - nd, meta.seq_lens[nd:],
                                           scale)])
    torch.testing.assert_close(out, ref, **_attention_tolerance(kv_dtype))


def test_a_request_of_no_tokens_gets_zeros() -> None:
    k_cache = torch.randn(2, 4, 1, 8)
    qkv = torch.randn(1, 3 * 8)
    out = cpu_ops.rope_store_attention(
        qkv, torch.zeros(1, dtype=torch.long), torch.ones(4, 8), torch.zeros(4, 8), None, None, 1e-6, k_cache,
        k_cache.clone(), torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
        torch.full((1,), -1, dtype=torch.long), 1, 1, 1.0)
    assert torch.equal(out, torch.zeros(1, 1, 8))


def test_the_library_shares_torchs_openmp_runtime() -> None:
    """One libgomp.so.1 in the process: the ops' loops run on torch's threads instead of a second pool.
    (Wheels that bundle a renamed copy for themselves, e.g. sentencepiece's libgomp-<hash>.so, do not count.)"""
    cpu_ops.load()
    maps = open("/proc/self/maps").read()
    loaded = {line.split()[-1] for line in maps.splitlines() if line.endswith("/libgomp.so.1")}
    assert len(loaded) <= 1, loaded


@pytest.mark.parametrize("rows,out_features,in_features", [(1, 96, 64), (2, 40, 576), (2, 3, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_i8_is_the_integer_product_of_its_quantized_inputs(rows, out_features, in_features,
                                                                  with_bias) -> None:
    torch.manual_seed(3)
    weight, x = torch.randn(out_features, in_features), torch.randn(rows, in_features) * 5
    x[0, 7] = 40.0  # an outlier channel: only its block's scale follows it
    bias = torch.randn(out_features) if with_bias else None
    packed = cpu_ops.quantize_weight_int8(weight)
    w_q, w_scale = packed
    assert w_q.dtype == torch.int8 and int(w_q.abs().max()) <= 127
    torch.testing.assert_close(w_q.float() * w_scale[:, None], weight, rtol=0, atol=float(w_scale.max()) / 2 + 1e-6)
    # the reference: each block of 32 values of a row quantized with its own symmetric scale, the products of a
    # block summed exactly (int64), then scaled
    blocks = x.view(rows, -1, cpu_ops.QUANT_BLOCK)
    x_scale = blocks.abs().amax(dim=2, keepdim=True) / 127
    x_q = torch.round(blocks / x_scale).clamp(-127, 127).long()
    w_blocks = w_q.long().view(out_features, -1, cpu_ops.QUANT_BLOCK)
    partial = torch.einsum("rbk,obk->rbo", x_q, w_blocks).double()  # [rows, blocks, out]
    ref = (partial * x_scale.double()).sum(dim=1) * w_scale[None, :].double()
    if bias is not None:
        ref += bias.double()
    out = cpu_ops.linear_i8(x, packed, bias)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
    # and close to the float product (int8 rounding: ~1 % of the largest output)
    full = x @ weight.t() + (0 if bias is None else bias)
    assert float((out - full).abs().max()) < 0.03 * float(full.abs().max())


def _int8_reference(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The product linear_i8 and linear_i8_tiles compute: x's rows quantized in blocks of 32 with a symmetric
    scale each, the integer products of a block summed exactly, then scaled (float64)."""
    rows, out_features = x.shape[0], w_q.shape[0]
    blocks = x.view(rows, -1, cpu_ops.QUANT_BLOCK)
    largest = blocks.abs().amax(dim=2, keepdim=True)
    x_scale = largest / 127
    x_q = torch.round(blocks * (127 / largest)).clamp(-127, 127).long()  # as the kernels round: x * (127 / max)
    partial = torch.einsum("rbk,obk->rbo", x_q, w_q.long().view(out_features, -1, cpu_ops.QUANT_BLOCK)).double()
    return (partial * x_scale.double()).sum(dim=1) * w_scale[None, :].double()


@pytest.mark.parametrize("out_features,in_features", [(16, 32), (48, 576), (80, 1536)])
def test_int8_tiles_hold_the_weight_in_their_layout(out_features, in_features) -> None:
    torch.manual_seed(4)
    weight = torch.randn(out_features, in_features)
    tiles, w_sum, scale = cpu_ops.quantize_weight_int8_tiles(weight)
    q, q_scale = cpu_ops.quantize_weight_int8(weight)
    assert torch.equal(scale, q_scale)
    t, k4, c, i = 2 % tiles.shape[0], 5 % tiles.shape[1], 11, 3
    assert tiles[t, k4, c, i] == q[t * 16 + c, k4 * 4 + i]
    assert torch.equal(tiles.permute(0, 2, 1, 3).reshape(out_features, in_features), q)
    assert torch.equal(w_sum.permute(0, 2, 1).reshape(out_features, -1), 128 * q.view(out_features, -1, 32).sum(-1))
    assert cpu_ops.quantize_weight_int8_tiles(torch.randn(24, 64)) is None  # out not a multiple of 16
    assert cpu_ops.quantize_weight_int8_tiles(torch.randn(16, 48)) is None  # in not a multiple of 32


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("out_features,in_features", [(16, 32), (48, 576), (80, 1536)])
def test_linear_i8_tiles_is_linear_i8s_product_at_any_row_count(rows, out_features, in_features) -> None:
    torch.manual_seed(rows)
    weight, x, bias = torch.randn(out_features, in_features), torch.randn(rows, in_features) * 5, torch.randn(out_features)
    x[0, 7] = 40.0  # an outlier channel: only its block's scale follows it
    tiles = cpu_ops.quantize_weight_int8_tiles(weight)
    q, w_scale = cpu_ops.quantize_weight_int8(weight)
    out = cpu_ops.linear_i8_tiles(x, tiles, bias)
    torch.testing.assert_close(out.double(), _int8_reference(x, q, w_scale) + bias.double(), rtol=1e-5, atol=1e-4)
    few_rows = torch.cat([cpu_ops.linear_i8(x[r:r + 1].contiguous(), (q, w_scale), bias) for r in range(rows)])
    torch.testing.assert_close(out, few_rows, rtol=1e-5, atol=1e-4)
    # rows given normalized with their scales apart (platforms/cpu/row_scale.RowScaled) give the same product
    row_max = x.abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(cpu_ops.linear_i8_tiles(x / row_max, tiles, bias, row_max), out, rtol=1e-5, atol=1e-4)
    full = x @ weight.t() + bias
    assert float((out - full).abs().max()) < 0.03 * float(full.abs().max())


def test_the_plain_tiles_loop_gives_the_vnni_kernels_numbers(tmp_path, monkeypatch) -> None:
    """Without AVX512-VNNI the tiles run a plain C loop (what the suite runs on such CPUs): built so here, it must
    give this build's numbers (on a CPU without VNNI both builds are that loop)."""
    import ctypes

    monkeypatch.setenv("NANOVLLM_CACHE_DIR", str(tmp_path))
    plain = ctypes.CDLL(str(cpu_ops.build(cpu_ops._compiler(), ("-mno-avx512vnni",))))
    plain.linear_i8_tiles_vnni.restype = ctypes.c_int
    assert plain.linear_i8_tiles_vnni() == 0
    function = plain.linear_i8_tiles_f32
    function.argtypes, function.restype = cpu_ops.SIGNATURES["linear_i8_tiles_f32"], None
    torch.manual_seed(5)
    for rows, out_features, in_features in ((1, 48, 576), (2, 64, 64), (9, 80, 1536), (64, 96, 576)):
        weight, x, bias = torch.randn(out_features, in_features), torch.randn(rows, in_features), torch.randn(out_features)
        tiles = cpu_ops.quantize_weight_int8_tiles(weight)
        y = torch.empty(rows, out_features)
        function(x.data_ptr(), None, tiles.tiles.data_ptr(), tiles.w_sum.data_ptr(), tiles.scale.data_ptr(),
                 bias.data_ptr(), y.data_ptr(), rows, in_features, out_features, 2)
        torch.testing.assert_close(y, cpu_ops.linear_i8_tiles(x, tiles, bias), rtol=1e-6, atol=1e-5)


def test_int8_tiles_are_wanted_where_asked_or_where_the_cpu_has_vnni(monkeypatch) -> None:
    from nanovllm.platforms.cpu.settings import int8_tiles_wanted

    for value, wanted in (("1", True), ("0", False), ("auto", bool(cpu_ops.load().linear_i8_tiles_vnni()))):
        monkeypatch.setenv("NANOVLLM_CPU_INT8_TILES", value)
        assert int8_tiles_wanted() == wanted
    monkeypatch.setenv("NANOVLLM_CPU_INT8_TILES", "yes")
    with pytest.raises(ValueError, match="NANOVLLM_CPU_INT8_TILES must be 0, 1 or auto, got 'yes'"):
        int8_tiles_wanted()
