"""The per-channel-scaled fp8 GEMM (kernels/fp8_gemm.py) against the formula it computes and torch._scaled_mm's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from nanovllm.kernels.fp8_gemm import Fp8GemmConfig, fp8_linear  # noqa: E402
from nanovllm.layers.quantization.fp8 import quantize_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(m: int, n: int, k: int):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[:, None]  # rows of different sizes
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, n)[:, None]
    (xq, xs), (wq, ws) = quantize_rows(x), quantize_rows(w)
    bias = torch.randn(n, generator=g)
    expected = (xq.float() * xs) @ (wq.float() * ws).t()
    return [t.to(DEVICE) for t in (xq, xs, wq, ws.view(-1), bias, expected)]


def _magnitudes(xq, xs, wq, ws) -> torch.Tensor:
    """sum_k |x_k w_k| of each output."""
    return (xq.float() * xs).abs() @ (wq.float() * ws.view(-1, 1)).abs().t()


def _rounding_bound(xq, xs, wq, ws) -> torch.Tensor:
    """The float32 error a K-term dot product may carry in any summation order: K * eps * sum_k |x_k w_k|."""
    return xq.shape[1] * torch.finfo(torch.float32).eps * _magnitudes(xq, xs, wq, ws)


@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("m,n", [(40, 96), (16, 32), (3, 80)])  # ragged row and column tiles; fewer rows than a tile
def test_fp8_linear_equals_the_formula(m, n, tma):
    xq, xs, wq, ws, bias, expected = _operands(m, n, 256)
    config = Fp8GemmConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2, tma=tma)
    y = fp8_linear(xq, xs, wq, ws, None, torch.float32, config)
    assert ((y - expected).abs() <= _rounding_bound(xq, xs, wq, ws)).all()
    with_bias = fp8_linear(xq, xs, wq, ws, bias, torch.bfloat16, config)
    assert with_bias.dtype == torch.bfloat16 and with_bias.shape == (m, n)
    torch.testing.assert_close(with_bias, (expected + bias).to(torch.bfloat16))


@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("split_k", [2, 3, 8])  # 8: more splits than K has tiles (four), so four of one tile
@pytest.mark.parametrize("m,n", [(40, 96), (3, 80)])  # ragged row tiles; fewer rows than a tile, ragged columns
def test_fp8_linear_split_over_k_equals_the_formula_and_leaves_its_counters_zero(m, n, split_k, tma):
    from nanovllm.kernels.jit import ticket_counters
    xq, xs, wq, ws, bias, expected = _operands(m, n, 256)
    tiling = dict(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2, tma=tma)
    whole = fp8_linear(xq, xs, wq, ws, bias, torch.float32, Fp8GemmConfig(**tiling))
    for _ in range(2):  # the second call finds the counters the first left
        y = fp8_linear(xq, xs, wq, ws, bias, torch.float32, Fp8GemmConfig(**tiling, split_k=split_k))
        assert ((y - expected - bias).abs() <= _rounding_bound(xq, xs, wq, ws) + 1e-6 * bias.abs()).all()
        torch.testing.assert_close(y, whole, rtol=1e-5, atol=1e-5)
    tiles = -(-m // 16) * -(-n // 32)
    assert not ticket_counters(xq.device, tiles).any()


def test_fp8_linear_refuses_a_k_that_is_not_a_multiple_of_its_tile():
    xq, xs, wq, ws, _, _ = _operands(8, 32, 96)
    with pytest.raises(AssertionError, match="multiple of 64"):
        fp8_linear(xq, xs, wq, ws, None, torch.float32, Fp8GemmConfig(block_m=16, block_n=32, block_k=64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [17, 128, 256, 500])
def test_fp8_linear_matches_scaled_mm_at_the_layers_shapes(m):
    """Both bf16 products against the exact formula: ours within bf16's rounding of each output plus a small share
    of its terms' magnitudes (the order and width of fp8 tensor-core sums, which cuBLAS widens more often: its
    mean error is ~0.8x ours), and within 1.5x of cuBLAS's mean error. (Against each other they differ by an ulp
    of bf16 at 0.4 % of outputs.)"""
    xq, xs, wq, ws, bias, expected = _operands(m, 4096, 4096)
    exact = expected + bias.bfloat16().float()
    reference = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), bias=bias.bfloat16(),
                                 out_dtype=torch.bfloat16)
    y = fp8_linear(xq, xs, wq, ws, bias.bfloat16(), torch.bfloat16)
    ours, library = (y.float() - exact).abs(), (reference.float() - exact).abs()
    assert (ours <= 2 ** -8 * exact.abs() + 2 ** -11 * _magnitudes(xq, xs, wq, ws)).all()
    assert ours.mean() <= 1.5 * library.mean() + 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [128, 256])
def test_fp8_linear_split_over_k_on_the_gpu_holds_the_same_bound(m):
    """The split-K tickets on real hardware (the interpreter runs programs one at a time): three splits of the 8B
    shape's down_proj, called three times (each call finds the counters the one before left), every output within
    the bound the unsplit product is held to, and within float32 reassociation of it."""
    xq, xs, wq, ws, bias, expected = _operands(m, 4096, 12288)
    exact = expected + bias.bfloat16().float()
    whole = fp8_linear(xq, xs, wq, ws, bias.bfloat16(), torch.float32,
                       Fp8GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4))
    split = Fp8GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4, split_k=3)
    bound = 2 ** -11 * _magnitudes(xq, xs, wq, ws)
    for _ in range(3):
        y = fp8_linear(xq, xs, wq, ws, bias.bfloat16(), torch.float32, split)
        assert ((y - exact).abs() <= 1e-6 * exact.abs() + bound).all()
        assert ((y - whole).abs() <= 1e-5 * whole.abs() + _rounding_bound(xq, xs, wq, ws)).all()
