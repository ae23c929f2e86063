"""The RMSNorm kernel (kernels/rms_norm.py) against layers/norm.py's ops: under the Triton interpreter without a
GPU (the conftest chooses it), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from nanovllm.layers.norm import RMSNorm, add_rms_norm, rms_norm

pytest.importorskip("triton")

from nanovllm.kernels import rms_norm as kernel  # noqa: E402
from tests.kernels.conftest import DEVICE  # noqa: E402


def one_ulp(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("hidden", [64, 96, 1024])  # 96: a row narrower than its power-of-two block
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("weight_dtype", ["same", "float32"])
def test_the_kernel_matches_the_ops(dtype, hidden, with_residual, weight_dtype):
    torch.manual_seed(hidden)
    rows = 5
    wide = torch.randn(rows, 2 * hidden, dtype=dtype, device=DEVICE) * 3
    x = wide[:, :hidden]  # a row stride of twice the row
    residual = torch.randn(rows, hidden, dtype=dtype, device=DEVICE) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype if weight_dtype == "same" else torch.float32)
    eps = 1e-6
    got = kernel.add_rms_norm(x, weight, eps, residual)
    if with_residual:
        want, want_sum = add_rms_norm.__wrapped__(x, residual, weight, eps)
        got, got_sum = got
        assert torch.equal(got_sum, want_sum)  # the add rounds as torch's does, bit for bit
    else:
        want = rms_norm.__wrapped__(x, weight, eps)
    assert got.dtype == want.dtype and got.shape == want.shape
    # only the sum of squares' order differs: at most one rounding step of the normed value
    torch.testing.assert_close(got, want, rtol=2 * one_ulp(dtype), atol=2 * one_ulp(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_the_e4m3_rows_are_the_16_bit_rows_quantized(dtype, with_residual):
    """add_rms_norm_e4m3 = quantize_rows (the fp8 layer's reference quantizer) of add_rms_norm's rows, bit for bit."""
    from nanovllm.layers.quantization.fp8 import quantize_rows
    torch.manual_seed(7)
    rows, hidden = 20, 96
    x = torch.randn(rows, hidden, dtype=dtype, device=DEVICE) * 3
    residual = torch.randn(rows, hidden, dtype=dtype, device=DEVICE) if with_residual else None
    weight = (1 + torch.rand(hidden, device=DEVICE) * torch.logspace(-2, 1, rows, device=DEVICE).repeat(5)[:hidden]
              ).to(dtype)  # rows' largest values, and so their scales, differ
    values, scale, summed = kernel.add_rms_norm_e4m3(x, weight, 1e-6, residual)
    plain = kernel.add_rms_norm(x, weight, 1e-6, residual)
    normed, plain_sum = plain if with_residual else (plain, None)
    want_values, want_scale = quantize_rows(normed)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (rows, 1)
    assert torch.equal(scale, want_scale) and scale.unique().numel() > 1
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    if with_residual:
        assert torch.equal(summed, plain_sum)
    else:
        assert summed is None


def test_no_rows_and_the_layers_it_does_not_take():
    weight = torch.ones(32, device=DEVICE)
    assert kernel.add_rms_norm(torch.empty(0, 32, device=DEVICE), weight, 1e-6).shape == (0, 32)
    assert not kernel.fits(torch.zeros(2, 3, 32), weight)  # q/k heads as [tokens, heads, dim]: the ops take them
    assert not kernel.fits(torch.zeros(32, 2).t(), weight)  # no unit stride on the row
    assert not kernel.fits(torch.zeros(2, 32), weight, torch.zeros(2, 32, dtype=torch.float16))
    assert not kernel.fits(torch.zeros(2, kernel.MAX_HIDDEN + 1), torch.ones(kernel.MAX_HIDDEN + 1))
    assert not kernel.takes(torch.zeros(2, 32), weight)  # CPU rows: the ops (or the CPU's own layers)
    with pytest.raises(AssertionError, match="rows of at most"):
        kernel.add_rms_norm(torch.zeros(2, 3, 32), weight, 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 8, 16, 300])
def test_the_layer_takes_the_kernel_for_few_rows_on_the_gpu(rows):
    torch.manual_seed(rows)
    norm = RMSNorm(1024).to(device="cuda", dtype=torch.bfloat16)
    norm.weight.data.normal_(1, 0.1)
    x = torch.randn(rows, 1024, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn_like(x)
    out, summed = norm(x, residual)
    want, want_sum = add_rms_norm.__wrapped__(x, residual, norm.weight, norm.eps)
    assert torch.equal(summed, want_sum)
    torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)
    assert kernel.fits(x, norm.weight, residual)
    assert kernel.takes(x, norm.weight, residual) == (rows <= 16)  # a prefill's rows keep the compiled ops


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_norm_before_an_fp8_layer_hands_it_e4m3_rows_above_a_decode_steps():
    from nanovllm.layers.quantization.fp8 import QuantizedRows
    norm = RMSNorm(1024).to(device="cuda", dtype=torch.bfloat16)
    norm.e4m3_output = True
    for rows in (16, 300):
        x = torch.randn(rows, 1024, dtype=torch.bfloat16, device="cuda")
        out, summed = norm(x, torch.randn_like(x))
        assert isinstance(out, QuantizedRows) == (rows > 16)  # a decode step's rows go to the few-row GEMM as bf16
    assert out.dtype == torch.bfloat16 and out.shape == (300, 1024)
