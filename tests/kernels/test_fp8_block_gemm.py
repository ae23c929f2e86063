"""The block-scaled fp8 GEMM (an HF fp8 checkpoint's 128 x 128 weight blocks, activations per token and group of
128) against the same numbers dequantized and multiplied in float32."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from nanovllm.kernels.fp8_block_gemm import (  # noqa: E402
    FP8_DTYPE,
    block_fp8_linear,
    dequantize_rows,
    quantize_groups,
    scale_rows,
)
from tests.kernels.conftest import DEVICE  # noqa: E402


def _block_weight(n: int, k: int, block: tuple[int, int], g: torch.Generator):
    """An e4m3 weight whose blocks have very different scales (one scale for all would lose the small ones)."""
    grid = (-(-n // block[0]), k // block[1])
    scale_inv = torch.logspace(-4, -1, grid[0] * grid[1]).view(grid)[:, torch.randperm(grid[1], generator=g)]
    values = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8_DTYPE)
    return values, scale_inv.float().contiguous()


@pytest.mark.parametrize("m, n, k, block", [(1, 256, 256, (128, 128)), (37, 200, 384, (128, 128)),
                                            (70, 96, 64, (32, 32))])
def test_block_gemm_matches_the_dequantized_product(m, n, k, block) -> None:
    g = torch.Generator().manual_seed(m + n + k)
    weight, scale_inv = _block_weight(n, k, block, g)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k)  # groups of different sizes
    bias = torch.randn(n, generator=g)
    scales = scale_rows(scale_inv, block[0], n)
    assert scales.shape == (n, k // block[1]) and torch.equal(scales[::block[0]], scale_inv)
    out = block_fp8_linear(x.to(DEVICE), weight.to(DEVICE), scales.to(DEVICE), block[1], bias.to(DEVICE)).cpu()
    xq, xs = quantize_groups(x, block[1])
    dequantized = dequantize_rows(weight, scales, block[1])
    expected = (xq.float() * xs.repeat_interleave(block[1], 1)) @ dequantized.t()
    torch.testing.assert_close(out, expected + bias, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    # and close to the float product: the activations' rounding is all that is lost
    exact = x @ dequantized.t() + bias
    assert ((out - exact).norm() / exact.norm()) < 0.05


def test_block_gemm_refuses_mismatched_scales() -> None:
    weight = torch.zeros(256, 256, dtype=FP8_DTYPE)
    with pytest.raises(AssertionError, match="do not match"):
        block_fp8_linear(torch.zeros(1, 256), weight, torch.ones(2, 2), 128)


def test_quantize_groups_keeps_each_groups_largest_value() -> None:
    x = torch.tensor([[1.0, -4.0, 0.5, 0.25], [0.0, 0.0, 3e-3, 1e-3]])
    q, scale = quantize_groups(x, 2)
    assert scale.shape == (2, 2)
    assert q.float().abs().view(2, 2, 2).amax(-1).tolist() == [[448.0, 448.0], [0.0, 448.0]]
    torch.testing.assert_close(q.float() * scale.repeat_interleave(2, 1), x, rtol=2 ** -4, atol=0)
