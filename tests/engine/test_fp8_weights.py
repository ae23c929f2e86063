"""quantization="fp8": linear weights in e4m3 with a scale per output channel, activations with one per token."""

from __future__ import annotations

import pytest
import torch

from nanovllm.config import EngineConfig
from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.layers.quantization.fp8 import (
    FP8_DTYPE,
    Fp8LinearMethod,
    QuantizedRows,
    quantize_linear_layers,
    quantize_rows,
    silu_and_mul_quantize_rows,
)


def _layer(in_features: int, out_features: int, bias: bool) -> ReplicatedLinear:
    g = torch.Generator().manual_seed(in_features + out_features)
    layer = ReplicatedLinear(in_features, out_features, bias=bias)
    # rows of very different magnitudes: a single scale for the whole weight would lose the small ones
    layer.weight.data = torch.randn(out_features, in_features, generator=g) * torch.logspace(-3, 1, out_features)[:, None]
    if bias:
        layer.bias.data = torch.randn(out_features, generator=g)
    return layer


def test_quantize_rows_keeps_each_rows_largest_value() -> None:
    x = torch.tensor([[0.5, -2.0, 1.0], [0.0, 0.0, 0.0], [1e-4, 3e-4, -2e-4]])
    q, scale = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (3, 1) and torch.isfinite(scale).all()
    assert q.float().abs().amax(dim=1).tolist() == [448.0, 0.0, 448.0]
    torch.testing.assert_close(q.float() * scale, x, rtol=2 ** -4, atol=0)


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_is_close_to_the_float_one(bias: bool) -> None:
    layer = _layer(64, 48, bias)
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(1))
    expected = layer(x)
    count = quantize_linear_layers(layer)
    method = layer.linear_method
    assert count == 1 and isinstance(method, Fp8LinearMethod) and method.weight.dtype == FP8_DTYPE
    assert layer.weight.numel() == 0  # the float weight is released: one copy of the weights
    out = layer(x)
    assert out.shape == expected.shape and out.dtype == x.dtype
    # relative to each output channel's own size: per-channel scales keep the small rows as exact as the large
    error = ((out - expected).norm(dim=(0, 1)) / expected.norm(dim=(0, 1)))
    assert error.max() < 0.08, error
    # the same numbers as the formula in the module's docstring
    xq, xs = quantize_rows(x.reshape(-1, 64))
    wq = method.weight.float() * method.weight_scale.view(-1, 1)
    formula = (xq.float() * xs) @ wq.t() + (layer.bias if bias else 0)
    torch.testing.assert_close(out.reshape(-1, 48), formula, rtol=1e-5, atol=1e-5)


def test_quantized_rows_are_multiplied_as_they_are() -> None:
    """down_proj takes the e4m3 rows and scales SwiGLU's fused kernel hands it, without quantizing them again."""
    layer = _layer(64, 48, False)
    quantize_linear_layers(layer)
    gate_up = torch.randn(7, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    values, scale = silu_and_mul_quantize_rows(gate_up)
    out = layer(QuantizedRows(values, scale, torch.bfloat16))
    weight = layer.linear_method.weight.float() * layer.linear_method.weight_scale.view(-1, 1)
    assert out.dtype == torch.bfloat16 and out.shape == (7, 48)
    torch.testing.assert_close(out, ((values.float() * scale) @ weight.t()).to(torch.bfloat16))
    # the reference's activation is that of layers/activation.py, rounded to bfloat16, then quantized
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(QuantizedRows(values, scale, torch.bfloat16).materialize().float(),
                               (torch.nn.functional.silu(gate.float()) * up.float()), rtol=0.07, atol=1e-3)


def test_the_triton_gemm_takes_its_rows_and_whole_k_tiles_only(monkeypatch) -> None:
    """With a row range set, those products run in kernels/fp8_gemm.py (here under the interpreter) with the
    numbers of the formula; an in_features that is not whole 128-wide tiles (SmolLM2's 576) stays in cuBLAS."""
    pytest.importorskip("triton")
    layer = _layer(256, 48, True)
    quantize_linear_layers(layer)
    method = layer.linear_method
    assert not method._triton_gemm_takes(20)  # off by default; and no CUDA here
    method.scaled_mm = True  # as on a GPU: the Triton path is then the only one this CPU can run
    monkeypatch.setattr(Fp8LinearMethod, "triton_gemm_rows", (17, 512))
    assert [method._triton_gemm_takes(rows) for rows in (16, 17, 512, 513)] == [False, True, True, False]
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(3))
    xq, xs = quantize_rows(x)
    formula = (xq.float() * xs) @ (method.weight.float() * method.weight_scale.view(-1, 1)).t() + layer.bias
    torch.testing.assert_close(layer(x), formula, rtol=1e-4, atol=1e-4)
    smol_width = _layer(576, 48, False)
    quantize_linear_layers(smol_width)
    smol_width.linear_method.scaled_mm = True
    assert not smol_width.linear_method._triton_gemm_takes(20)


def test_norms_hand_e4m3_rows_only_to_the_one_fp8_layer_reading_them(monkeypatch) -> None:
    """quantize_norm_outputs: each layer's input norm (read by qkv_proj alone) and a dense MLP's post-attention norm
    (gate_up_proj alone) hand e4m3 rows where the layer multiplies them; not an MoE's (its router reads them too),
    not the final norm (the LM head), and nothing where the layers dequantize (the CPU reference) or where
    Fp8LinearMethod.norm_hands_e4m3_rows is off."""
    from nanovllm.models import model_class
    from nanovllm.models.decoder import DecoderMLP, quantize_norm_outputs
    from tests.helpers import tiny_config
    config = tiny_config("qwen3_moe")  # layer 1 dense, layers 0, 2 and 3 sparse
    model = model_class(config)(config, 128)
    quantize_linear_layers(model)
    monkeypatch.setattr(Fp8LinearMethod, "norm_hands_e4m3_rows", True)
    assert quantize_norm_outputs(model) == 0
    for module in model.modules():
        if isinstance(getattr(module, "linear_method", None), Fp8LinearMethod):
            module.linear_method.scaled_mm = True  # as on a GPU
    assert quantize_norm_outputs(model) == 4 + 1
    monkeypatch.setattr(Fp8LinearMethod, "norm_hands_e4m3_rows", False)
    assert quantize_norm_outputs(model) == 0
    for i, layer in enumerate(model.model.layers):
        assert layer.input_layernorm.e4m3_output
        assert layer.post_attention_layernorm.e4m3_output == isinstance(layer.mlp, DecoderMLP) == (i == 1)
    assert not model.model.norm.e4m3_output


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4", device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_scaled_mm_matches_the_reference_path() -> None:
    layer = _layer(256, 128, True).cuda().to(torch.bfloat16)
    quantize_linear_layers(layer)
    assert layer.linear_method.scaled_mm
    torch.manual_seed(0)
    x = torch.randn(33, 256, device="cuda", dtype=torch.bfloat16)
    out = layer(x)
    layer.linear_method.scaled_mm = False
    reference = layer(x)
    # the two paths round the activations to e4m3 in different places: an element may move by a step of e4m3
    # (1/16 of its size), the whole product by far less on average
    torch.testing.assert_close(out, reference, rtol=2e-2, atol=5e-2)
    assert (out.float() - reference.float()).abs().mean() < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp8_activations", [True, False])
def test_decode_sized_batches_take_the_few_row_gemm(fp8_activations: bool, monkeypatch) -> None:
    from nanovllm.kernels import skinny_gemm
    layer = _layer(256, 128, True).cuda().to(torch.bfloat16)
    quantize_linear_layers(layer)
    method = layer.linear_method
    monkeypatch.setattr(type(method), "few_row_fp8_activations", fp8_activations)
    calls = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    out = layer(x)
    assert calls == [FP8_DTYPE if fp8_activations else torch.bfloat16]
    if fp8_activations:  # the same numbers as the reference path, which quantizes x too
        method.scaled_mm = False
        monkeypatch.setattr(skinny_gemm, "takes", lambda *a, **k: False)
        reference = layer(x)
    else:  # x as it is, against the e4m3 weight
        weight = method.weight.float() * method.weight_scale.view(-1, 1)
        reference = (x.float() @ weight.t() + layer.bias.float()).to(x.dtype)
    torch.testing.assert_close(out, reference, rtol=2e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_swiglu_quantizes_its_activation_in_one_kernel() -> None:
    """Above decode-sized batches an fp8 MLP's gate_up hands down_proj QuantizedRows (silu * up quantized by one
    kernel); the MLP's output is that of the unfused reference path."""
    from types import SimpleNamespace

    from nanovllm.models.decoder import DecoderMLP
    torch.manual_seed(0)
    mlp = DecoderMLP(SimpleNamespace(hidden_size=256, intermediate_size=512, hidden_act="silu"))
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.weight.data = torch.randn_like(layer.weight) * 0.05
    mlp = mlp.cuda().to(torch.bfloat16)
    quantize_linear_layers(mlp)
    x = torch.randn(200, 256, device="cuda", dtype=torch.bfloat16)
    handed = mlp.gate_up_proj.forward_silu_and_mul(x, mlp.act)
    assert isinstance(handed, QuantizedRows) and handed.values.shape == (200, 512)
    out = mlp(x)
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.linear_method.scaled_mm = False
    reference = mlp(x)
    torch.testing.assert_close(out, reference, rtol=2e-2, atol=5e-2)
    assert (out.float() - reference.float()).abs().mean() < 5e-3
