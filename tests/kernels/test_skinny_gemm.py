"""The few-row GEMM (kernels/skinny_gemm.py) against torch: under the Triton interpreter without a GPU (the
conftest chooses it), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanovllm.kernels.jit import ticket_counters
from nanovllm.kernels.skinny_gemm import SkinnyConfig, fits, skinny_linear, takes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x, weight, bias=None, gated=False):
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    if not gated:
        return y
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate.float()).to(x.dtype) * up


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("gated", [False, True])
def test_skinny_linear_matches_torch(rows, split_k, gated):
    torch.manual_seed(rows + 10 * split_k)
    n, k = 80, 320  # a ragged last column block and a ragged last K tile
    x = torch.randn(rows, k, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.randn(2 * n if gated else n, k, dtype=torch.bfloat16, device=DEVICE) / k ** 0.5
    config = SkinnyConfig(block_n=64, block_k=64, split_k=split_k, num_warps=4, num_stages=2)
    out = skinny_linear(x, weight, gated=gated, config=config)
    assert out.shape == (rows, n)
    torch.testing.assert_close(out, reference(x, weight, gated=gated), rtol=2e-2, atol=2e-2)
    assert int(ticket_counters(out.device, 2).abs().sum()) == 0  # every call leaves its tickets at zero


def test_skinny_linear_with_bias_and_a_strided_input():
    torch.manual_seed(0)
    x = torch.randn(4, 2 * 128, dtype=torch.float16, device=DEVICE)[:, ::1][:, :128]  # row stride 256
    weight = torch.randn(48, 128, dtype=torch.float16, device=DEVICE) / 12
    bias = torch.randn(48, dtype=torch.float16, device=DEVICE)
    out = skinny_linear(x, weight, bias, config=SkinnyConfig(block_n=32, block_k=32, split_k=2))
    torch.testing.assert_close(out, reference(x, weight, bias), rtol=2e-2, atol=2e-2)


def test_repeated_calls_give_the_same_bits():
    torch.manual_seed(1)
    x = torch.randn(3, 256, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.randn(64, 256, dtype=torch.bfloat16, device=DEVICE)
    config = SkinnyConfig(block_n=32, block_k=32, split_k=4)
    first = skinny_linear(x, weight, config=config)
    assert torch.equal(first, skinny_linear(x, weight, config=config))


def test_fits_only_few_16_bit_rows():
    weight = torch.zeros(8, 32, dtype=torch.bfloat16)
    assert fits(torch.zeros(16, 32, dtype=torch.bfloat16), weight)
    assert not fits(torch.zeros(17, 32, dtype=torch.bfloat16), weight)
    assert not fits(torch.zeros(4, 32, dtype=torch.float32), weight.float())
    with pytest.raises(AssertionError, match="<= 16"):
        skinny_linear(torch.zeros(17, 32, dtype=torch.bfloat16), weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize(("n", "k", "gated"), [(4096, 1024, False), (1024, 2048, False), (3072, 1024, True),
                                               (1024, 3072, False), (12288, 4096, True)])
def test_skinny_linear_at_decode_shapes_on_the_gpu(rows, n, k, gated):
    torch.manual_seed(rows)
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(2 * n if gated else n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
    for _ in range(2):  # the second call finds the ticket counters the first left
        out = skinny_linear(x, weight, gated=gated)
        torch.testing.assert_close(out, reference(x, weight, gated=gated), rtol=2e-2, atol=2e-2)
    assert takes(x, weight, gated) == (gated or n * k * 2 <= 8 << 20)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("fp8_activations", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_with_an_e4m3_weight(gated, fp8_activations, bias):
    from nanovllm.layers.quantization.fp8 import quantize_rows
    torch.manual_seed(3)
    n, k = 80, 320
    x = torch.randn(5, k, dtype=torch.bfloat16, device=DEVICE)
    weight, weight_scale = quantize_rows(torch.randn(2 * n if gated else n, k, device=DEVICE) / k ** 0.5)
    b = torch.randn(2 * n if gated else n, dtype=torch.bfloat16, device=DEVICE) if bias else None
    config = SkinnyConfig(block_n=64, block_k=64, split_k=3, num_warps=4, num_stages=2)
    dequantized = (weight.float() * weight_scale).to(torch.bfloat16)
    if fp8_activations:
        x_fp8, x_scale = quantize_rows(x)
        out = skinny_linear(x_fp8, weight, b, gated=gated, config=config, weight_scale=weight_scale.view(-1),
                            x_scale=x_scale, out_dtype=torch.bfloat16)
        x_used = (x_fp8.float() * x_scale).to(torch.bfloat16)
    else:
        out = skinny_linear(x, weight, b, gated=gated, config=config, weight_scale=weight_scale.view(-1))
        x_used = x
    assert out.shape == (5, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference(x_used, dequantized, b, gated=gated), rtol=2e-2, atol=2e-2)
    # and not the product of the raw e4m3 codes: the scales were applied
    assert (out.float() - reference(x_used, weight.float().to(torch.bfloat16), b, gated).float()).abs().max() > 0.1


def test_fits_takes_e4m3_weights_and_activations():
    fp8 = torch.float8_e4m3fn
    weight = torch.zeros(8, 32, dtype=fp8)
    assert fits(torch.zeros(4, 32, dtype=torch.bfloat16), weight)
    assert fits(torch.zeros(4, 32, dtype=fp8), weight)
    assert not fits(torch.zeros(4, 32, dtype=fp8), torch.zeros(8, 32, dtype=torch.bfloat16))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("prefetch", [0, 64, 128, 256, None])
def test_the_weight_read_before_the_wait_gives_the_same_product(gated, prefetch):
    torch.manual_seed(7)
    n, k = 80, 448  # splits of 192 keys: a head of 128 leaves one tile to the loop, of 256 covers past the split
    x = torch.randn(5, k, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.randn(2 * n if gated else n, k, dtype=torch.bfloat16, device=DEVICE) / k ** 0.5
    config = SkinnyConfig(block_n=32, block_k=64, split_k=3, num_stages=2, prefetch_k=prefetch)
    torch.testing.assert_close(skinny_linear(x, weight, gated=gated, config=config),
                               reference(x, weight, gated=gated), rtol=2e-2, atol=2e-2)


def test_the_head_read_before_the_wait_fits_its_budget():
    from nanovllm.kernels.skinny_gemm import PREFETCH_BYTES, prefetch_k
    config = SkinnyConfig(block_n=32, block_k=128, split_k=2)
    assert prefetch_k(config, 512, gated=False) == 512  # the whole slice: 32 KiB
    assert prefetch_k(config, 384, gated=False) == 256  # a power of two within the slice
    assert prefetch_k(config, 1024, gated=False) == 512  # capped by the budget
    assert prefetch_k(config, 1024, gated=True) == 256  # gate and up rows both
    assert prefetch_k(SkinnyConfig(32, 256, 2), 1024, gated=False) == 512  # e4m3 tiles count as upcast
    assert prefetch_k(config, 64, gated=False) == 0  # less than one tile
    assert prefetch_k(config, 512, gated=False, weight_bytes=8 << 20) == 512
    assert prefetch_k(config, 512, gated=False, weight_bytes=(8 << 20) + 1) == 0  # a large weight reads none
    assert 512 * 32 * 2 == PREFETCH_BYTES
    with pytest.raises(AssertionError, match="power-of-two multiple"):
        prefetch_k(SkinnyConfig(32, 128, 2, prefetch_k=192), 512, gated=False)
