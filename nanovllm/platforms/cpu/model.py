"""A loaded CPU model made ready to run, once: the CPU's norm/activation/rotary layers (layers.py), every linear
layer's method (linear.py) and, under cpu_int8's fbgemm steps, where rows travel with their scale apart
(row_scale.py)."""

from __future__ import annotations

from torch import nn

from nanovllm.models.decoder import DecoderLayer, DecoderMLP
from nanovllm.platforms.cpu.decoder_layer import use_compiled_layers
from nanovllm.platforms.cpu.layers import CpuRMSNorm, CpuSiluAndMul, use_block_embedding, use_cpu_layers
from nanovllm.platforms.cpu.linear import Int8Linear, use_linear_methods


def prepare_model(model: nn.Module, kind: str, int8_tiles: bool = False, block_passes: int | None = None) -> None:
    """kind: the config's ``cpu_linear`` (settings.CPU_LINEAR_METHODS); int8_tiles, block_passes: the config's
    ``cpu.int8_tiles`` and ``cpu.block_passes``."""
    use_cpu_layers(model)
    use_linear_methods(model, kind, int8_tiles, block_passes)
    use_block_embedding(model)
    use_compiled_layers(model)
    if kind == "int8":
        plan_row_scales(model)


def plan_row_scales(model: nn.Module) -> int:
    """cpu_int8's fbgemm steps (row_scale.py): the norms and the activation that feed int8 linears write their rows
    normalized, and o_proj, gate_up_proj and down_proj hand their products on with the row scale still to apply, to
    the residual add + norm and the activation after them, which apply it as they read: six passes over a tensor
    fewer per layer. Only in decoder layers whose linears all take such rows, on one rank, and whose norms and
    activation are the CPU's (the next layer's norm, or the model's last, reads the scale down_proj leaves);
    returns how many layers."""
    count = 0
    for layer in model.modules():
        if not isinstance(layer, DecoderLayer) or not isinstance(layer.mlp, DecoderMLP):
            continue  # experts multiply in the model's dtype
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(not isinstance(linear.linear_method, Int8Linear) or not linear.linear_method.takes_row_scaled
               or linear.tp_size > 1 for linear in linears):
            continue
        norms_and_act = (layer.input_layernorm, layer.post_attention_layernorm, mlp.act)
        if not all(isinstance(op, (CpuRMSNorm, CpuSiluAndMul)) for op in norms_and_act):
            continue
        for op in norms_and_act:
            op.emits_row_scaled = True
        for linear in linears[1:]:
            linear.linear_method.keeps_row_scale = True
        count += 1
    return count
