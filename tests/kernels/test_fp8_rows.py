"""The fp8 linear layers' activation quantizers (kernels/fp8.quantize_rows_e4m3, and the one fused with SwiGLU's
activation) against the torch references (layers/quantization/fp8.quantize_rows, silu_and_mul_quantize_rows): the same bits, under the interpreter without a GPU and compiled on one."""

from __future__ import annotations

import pytest
import torch

from nanovllm.kernels.fp8 import quantize_rows_e4m3, silu_and_mul_quantize_rows_e4m3
from nanovllm.layers.quantization.fp8 import FP8_DTYPE, quantize_rows, silu_and_mul_quantize_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("cols", [48, 5000])  # one block; several blocks with a ragged last one
def test_quantize_rows_e4m3_equals_the_reference(dtype, cols):
    g = torch.Generator().manual_seed(cols)
    # rows of very different sizes, a row of zeros, and a row with one outlier
    x = torch.randn(6, cols, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 1.0, 1e3])[:, None]
    x[4, cols // 2] = 500.0
    x = x.to(dtype).to(DEVICE)
    values, scale = quantize_rows_e4m3(x)
    expected_values, expected_scale = quantize_rows(x)
    assert values.dtype == FP8_DTYPE and scale.shape == (6, 1) and scale.dtype == torch.float32
    assert torch.equal(scale, expected_scale)
    assert torch.equal(values.view(torch.uint8), expected_values.view(torch.uint8))


def test_quantize_rows_e4m3_takes_a_row_stride_and_no_rows():
    x = torch.randn(4, 256, dtype=torch.bfloat16, device=DEVICE)[:, :100]  # row stride 256
    values, scale = quantize_rows_e4m3(x)
    expected_values, expected_scale = quantize_rows(x)
    assert torch.equal(values.view(torch.uint8), expected_values.view(torch.uint8)) and torch.equal(scale, expected_scale)
    empty, empty_scale = quantize_rows_e4m3(x[:0])
    assert empty.shape == (0, 100) and empty_scale.shape == (0, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cols", [40, 2500])  # one block; several blocks with a ragged last one
def test_silu_and_mul_quantize_rows_e4m3_equals_the_reference(dtype, cols):
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(5, 2 * cols, generator=g) * torch.tensor([1e-2, 1.0, 8.0, 0.0, 1.0])[:, None]
    x[4, cols + cols // 3] = 300.0  # an outlier in up: it sets the row's scale
    x = x.to(dtype).to(DEVICE)
    values, scale = silu_and_mul_quantize_rows_e4m3(x)
    expected_values, expected_scale = silu_and_mul_quantize_rows(x)
    assert values.shape == (5, cols) and values.dtype == FP8_DTYPE and scale.shape == (5, 1)
    torch.testing.assert_close(scale, expected_scale, rtol=1e-6, atol=0)
    # exp may differ in its last bit, which can move an activation across a rounding boundary: one e4m3 step at
    # most, and rarely
    got, want = values.float() * scale, expected_values.float() * expected_scale
    torch.testing.assert_close(got, want, rtol=2 ** -3, atol=float(expected_scale.max()) * 2 ** -9)
    assert (got != want).float().mean() < 0.01
    assert scale[3].item() == pytest.approx(1e-12) and values[3].float().abs().max() == 0  # the row of zeros
