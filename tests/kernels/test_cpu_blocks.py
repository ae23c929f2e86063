"""The CPU's products on 4- and 8-bit weight blocks (cpu_ops.linear_blocks): GGUF's own blocks come back from their
dequantized weights, the product is an exact integer reference's, and every SIMD build gives the same numbers."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from nanovllm.platforms.cpu import cpu_ops

gguf = pytest.importorskip("gguf")
BLOCK = cpu_ops.QUANT_BLOCK

if cpu_ops.load() is None:
    pytest.fail("the CPU ops did not build (no C compiler, or NANOVLLM_CPU_KERNELS=0)", pytrace=False)


def gguf_weight(kind: str, out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """(the float32 weight GGUF's dequantization gives, the raw blocks) of a random weight quantized to kind."""
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    w = np.random.default_rng(seed).standard_normal((out_features, in_features)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(w, qtype)
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)), raw


def by_channel(scales: torch.Tensor) -> torch.Tensor:
    """BlockWeight's [out / 16, in / 32, 16] scales -> [out, in / 32]."""
    return scales.transpose(1, 2).reshape(-1, scales.shape[1])


@pytest.mark.parametrize("kind,bits", [("Q4_0", 4), ("Q4_1", 4), ("Q8_0", 8)])
def test_gguf_blocks_come_back_exactly_from_their_dequantized_weights(kind, bits) -> None:
    weight, raw = gguf_weight(kind, 48, 576)
    blocks = cpu_ops.block_weight(weight)
    assert blocks.bits == bits and blocks.shape == (48, 576)
    assert torch.equal(cpu_ops.dequantize_blocks(blocks), weight)
    # the file's own scales (each block starts with its float16 d, then Q4_1's m)
    raw = raw.reshape(48, 576 // BLOCK, -1)
    d = torch.from_numpy(raw[..., :2].copy().view(np.float16)[..., 0])
    if kind == "Q4_0":  # w = d (q - 8): the file's d (or -d where the block's q span 0 to 15, read as Q4_1's)
        assert torch.equal(by_channel(blocks.d).abs(), d.abs())
    else:
        assert torch.equal(by_channel(blocks.d), d)
    if kind == "Q4_1":
        assert torch.equal(by_channel(blocks.m), torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0]))


def test_other_weights_take_8_bit_blocks_and_odd_shapes_none() -> None:
    torch.manual_seed(0)
    weight = torch.randn(32, 64)
    blocks = cpu_ops.block_weight(weight)
    assert blocks.bits == 8 and blocks.m is None
    error = (cpu_ops.dequantize_blocks(blocks) - weight).abs().view(32, 2, BLOCK)
    assert bool((error <= weight.abs().view(32, 2, BLOCK).amax(-1, keepdim=True) / 254 * 1.001).all())
    with pytest.raises(ValueError, match="not exactly 4-bit blocks"):
        cpu_ops.block_weight(weight, bits=4)
    assert cpu_ops.block_weight(torch.randn(24, 64)) is None  # out not a multiple of 16
    assert cpu_ops.block_weight(torch.randn(16, 48)) is None  # in not a multiple of 32


def quantized_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, in] -> (int8 values [rows, blocks, 32], steps [rows, blocks], 127 / max [rows, blocks, 1]) as the
    kernels round: x * (127 / max) to the nearest integer."""
    xb = x.reshape(x.shape[0], -1, BLOCK)
    largest = xb.abs().amax(dim=2, keepdim=True)
    return torch.round(xb * (127 / largest)).clamp(-127, 127), (largest / 127)[..., 0], 127 / largest


def blocks_reference(x: torch.Tensor, weight: cpu_ops.BlockWeight, passes: int) -> torch.Tensor:
    """The product linear_blocks computes: x's rows quantized in blocks of 32 (symmetric), each block's integer
    sums exact, then scaled (float64); passes 2: plus the same of what the first rounding left out, rounded to
    steps 256 times finer than the first pass's."""
    out_features = weight.shape[0]
    w = cpu_ops.dequantize_blocks(weight).double().view(out_features, -1, BLOCK)
    xq, xs, inverse = quantized_blocks(x)
    if passes == 2:
        left = x.view_as(xq) - xq * xs[..., None]
        xq = xq * 256 + torch.round(left * (inverse * 256)).clamp(-127, 127)
        xs = xs / 256
    return torch.einsum("rbk,obk->rbo", xq.double(), w).mul(xs.double()[..., None]).sum(1)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("passes", [1, 2])
def test_linear_blocks_is_the_integer_reference_at_any_row_count(rows, kind, passes) -> None:
    torch.manual_seed(rows)
    weight, _ = gguf_weight(kind, 80, 1536, seed=rows)
    blocks = cpu_ops.block_weight(weight)
    x, bias = torch.randn(rows, 1536) * 5, torch.randn(80)
    x[0, 7] = 40.0  # an outlier channel: only its block's scale follows it
    out = cpu_ops.linear_blocks(x, blocks, bias, passes=passes)
    torch.testing.assert_close(out.double(), blocks_reference(x, blocks, passes) + bias.double(), rtol=1e-5, atol=1e-4)
    # rows given normalized with their scales apart (platforms/cpu/row_scale.RowScaled) give the same product
    row_max = x.abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(cpu_ops.linear_blocks(x / row_max, blocks, bias, row_max, passes), out, rtol=1e-5,
                               atol=1e-4)
    full = x @ weight.t() + bias
    # one pass: int8 activations (~0.5 % of the largest output); two: ~15 bits, near float32's product
    assert float((out - full).abs().max()) < (0.02 if passes == 1 else 2e-4) * float(full.abs().max())
    assert cpu_ops.linear_blocks(x.view(1, rows, 1536), blocks, None).shape == (1, rows, 80)


@pytest.mark.parametrize("flags,simd", [(("-mno-avx512f",), 1), (("-mno-avx512f", "-mno-avx2", "-mno-fma"), 0)])
def test_every_simd_build_gives_the_same_numbers(tmp_path, monkeypatch, flags, simd) -> None:
    """The AVX2 (maddubs) and plain C builds against this machine's (AVX512-VNNI where it has it): bit for bit."""
    monkeypatch.setenv("NANOVLLM_CACHE_DIR", str(tmp_path))
    lib = ctypes.CDLL(str(cpu_ops.build(cpu_ops._compiler(), flags)))
    lib.linear_blocks_simd.restype = ctypes.c_int
    assert lib.linear_blocks_simd() == simd
    function = lib.linear_blocks_f32
    function.argtypes, function.restype = cpu_ops.SIGNATURES["linear_blocks_f32"], None
    for kind, passes in (("Q4_0", 1), ("Q4_1", 2), ("Q8_0", 1), ("Q8_0", 2)):
        for rows, out_features, in_features in ((1, 48, 576), (2, 64, 64), (9, 80, 1536), (64, 96, 576)):
            blocks = cpu_ops.block_weight(gguf_weight(kind, out_features, in_features, seed=rows)[0])
            x, bias = torch.randn(rows, in_features), torch.randn(out_features)
            y = torch.empty(rows, out_features)
            function(x.data_ptr(), None, blocks.tiles.data_ptr(), blocks.d.data_ptr(),
                     None if blocks.m is None else blocks.m.data_ptr(), blocks.bits, passes, bias.data_ptr(),
                     y.data_ptr(), rows, in_features, out_features, 2)
            assert torch.equal(y, cpu_ops.linear_blocks(x, blocks, bias, passes=passes)), (kind, rows, passes)
    top = lib.linear_blocks_top_f32
    top.argtypes, top.restype = cpu_ops.SIGNATURES["linear_blocks_top_f32"], None
    for kind in ("Q4_1", "Q8_0"):
        blocks, x = top_inputs(kind, 9, 512, seed=2)
        bound, bias = cpu_ops.block_bound(blocks), torch.randn(512)
        y = torch.empty(9, 512)
        top(x.data_ptr(), None, blocks.tiles.data_ptr(), blocks.d.data_ptr(),
            None if blocks.m is None else blocks.m.data_ptr(), blocks.bits, bound.per_channel.data_ptr(),
            bound.largest.data_ptr(), bias.data_ptr(), y.data_ptr(), 9, 576, 512, 2)
        assert torch.equal(y, cpu_ops.linear_blocks_top(x, blocks, bound, bias)), kind


def top_inputs(kind: str, rows: int, out_features: int, seed: int):
    """A weight of kind (two of its channels equal: a tie) and rows of input with an outsized value each."""
    weight, _ = gguf_weight(kind, out_features, 576, seed=seed)
    weight[out_features - 3] = weight[40]
    blocks = cpu_ops.block_weight(weight)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 576, generator=generator)
    x[:, 7] *= 4
    return blocks, x


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_the_near_top_product_has_two_passes_where_the_largest_can_be(kind) -> None:
    """linear_blocks_top: every tile of 16 outputs is one pass's or two passes' (bit for bit); each row's largest
    is two passes' and so is its argmax, where one pass alone picks another token in some rows; ties go to the
    lowest id as in the two-pass product."""
    rows = 256
    blocks, x = top_inputs(kind, rows, 2048, seed=1)
    bias = torch.randn(2048) * 0.1
    one = cpu_ops.linear_blocks(x, blocks, bias, passes=1)
    two = cpu_ops.linear_blocks(x, blocks, bias, passes=2)
    bound = cpu_ops.block_bound(blocks)
    top = cpu_ops.linear_blocks_top(x, blocks, bound, bias)
    as_one, as_two = (top == one).view(rows, -1, 16).all(-1), (top == two).view(rows, -1, 16).all(-1)
    assert bool((as_one | as_two).all()), "whole tiles, one pass's or two passes'"
    assert torch.equal(top.argmax(-1), two.argmax(-1))
    assert bool((one.argmax(-1) != two.argmax(-1)).any()), "the test has rows where one pass alone picks another"
    assert torch.equal(top.amax(-1), two.amax(-1))
    refined = (as_two & ~as_one).sum(-1).float().mean()
    assert 1 <= refined < 32, f"{refined} of 128 tiles a row again"
    # the bound: at least every channel's sum of |w| over each block
    sums = cpu_ops.dequantize_blocks(blocks).double().abs().view(2048, -1, BLOCK).sum(-1)
    assert bool((bound.per_channel.double() >= sums).all()) and bool((bound.largest.double() >= sums.amax(0)).all())
    # channel 40 and its twin (2045) tie at the largest: the lowest id, as two passes
    twin = cpu_ops.dequantize_blocks(blocks)[40:41]
    assert int(cpu_ops.linear_blocks_top(twin, blocks, bound, None).argmax()) == 40
    assert int(cpu_ops.linear_blocks(twin, blocks, None, passes=2).argmax()) == 40


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_rows_dequantized_alone_are_the_whole_weights_rows(kind) -> None:
    weight, _ = gguf_weight(kind, 64, 96 * 2, seed=3)
    blocks = cpu_ops.block_weight(weight)
    rows = torch.tensor([5, 0, 63, 17, 5, 31, 16, 15])  # across tiles, repeated, out of order
    assert torch.equal(cpu_ops.dequantize_rows(blocks, rows), weight[rows])  # the compiled lookup
    assert torch.equal(cpu_ops.dequantize_rows_torch(blocks, rows), weight[rows])
    with pytest.raises(IndexError, match=r"outside \[0, 64\): \[64, -1\]"):
        cpu_ops.dequantize_rows(blocks, torch.tensor([3, 64, -1]))


def tied_embedding_and_head(weight: torch.Tensor):
    from torch import nn

    from nanovllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from nanovllm.platforms.cpu.linear import linear_method, set_linear_method

    model = nn.Module()
    model.embed_tokens = VocabParallelEmbedding(*weight.shape)
    model.lm_head = ParallelLMHead(*weight.shape)
    model.embed_tokens.weight.data.copy_(weight)
    model.lm_head.weight = model.embed_tokens.weight
    set_linear_method(model.lm_head, linear_method(weight, "blocks"), release=False)  # as a tied head gets it
    return model


def test_a_tied_embedding_reads_its_heads_blocks_where_they_hold_it_exactly() -> None:
    from nanovllm.platforms.cpu.layers import CpuBlockEmbedding, use_block_embedding

    weight, _ = gguf_weight("Q8_0", 64, 96)  # a GGUF embedding: its 8-bit blocks are exact
    model = tied_embedding_and_head(weight)
    head_blocks = model.lm_head.linear_method.weight
    hidden = torch.randn(3, 96)
    logits = model.lm_head(hidden)
    assert use_block_embedding(model) == 1
    assert isinstance(model.embed_tokens, CpuBlockEmbedding) and model.embed_tokens.blocks is head_blocks
    assert model.embed_tokens.weight.numel() == 0 and model.lm_head.weight.numel() == 0  # the float copy released
    ids = torch.tensor([[3, 63, 0], [3, 17, 40]])
    assert torch.equal(model.embed_tokens(ids), torch.nn.functional.embedding(ids, weight))
    assert torch.equal(model.lm_head(hidden), logits)


def test_an_embedding_its_blocks_round_keeps_its_float_weight() -> None:
    from nanovllm.layers.embedding import VocabParallelEmbedding
    from nanovllm.platforms.cpu.layers import use_block_embedding

    torch.manual_seed(0)
    model = tied_embedding_and_head(torch.randn(64, 96))  # float weights: the head's 8-bit blocks are rounded
    assert use_block_embedding(model) == 0
    assert type(model.embed_tokens) is VocabParallelEmbedding and model.embed_tokens.weight.shape == (64, 96)
