"""Qwen3-MoE: Qwen3's attention with a mixture of experts in place of the MLP in its sparse layers.

A layer is sparse unless ``mlp_only_layers`` lists it or ``(index + 1) % decoder_sparse_step`` is not 0 (as
transformers decides); the others keep the dense MLP of ``intermediate_size``. ``MoeDecoderForCausalLM`` is the
piece the other mixture-of-experts families (qwen2_moe.py, mixtral.py) share.
"""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers.fused_moe import FusedExperts, TopKRouter, checkpoint_name
from nanovllm.models.decoder import DecoderForCausalLM, DecoderMLP, FamilyTraits


class SparseMoeBlock(nn.Module):
    """Router + experts, and optionally a shared expert scaled by a sigmoid gate (Qwen2-MoE)."""

    def __init__(self, config, num_experts: int, renormalize: bool, intermediate_size: int,
                 expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 module_name: str = "mlp", shared_intermediate_size: int = 0):
        super().__init__()
        self.module_name = module_name
        self.gate = TopKRouter(config.hidden_size, num_experts, config.num_experts_per_tok, renormalize)
        self.gate.weight.checkpoint_names = lambda name: {checkpoint_name(name, module_name): None}
        self.experts = FusedExperts(num_experts, config.hidden_size, intermediate_size, expert_names, module_name)
        if shared_intermediate_size:
            self.shared_expert = DecoderMLP(config, shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False).requires_grad_(False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(hidden)
        out = self.experts(hidden, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return out

    def checkpoint_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """prefix: 'model.layers.{i}.' -> the checkpoint's tensors of this block, full (unsharded) shapes."""
        experts, hidden = self.gate.weight.shape
        intermediate = self.experts.intermediate * self.experts.tp_size
        gate, up, down = self.experts.names
        p = f"{prefix}{self.module_name}."
        shapes = {f"{p}gate.weight": (experts, hidden)}
        for e in range(experts):
            shapes[f"{p}experts.{e}.{gate}.weight"] = shapes[f"{p}experts.{e}.{up}.weight"] = (intermediate, hidden)
            shapes[f"{p}experts.{e}.{down}.weight"] = (hidden, intermediate)
        if self.shared_expert is not None:
            shared = self.shared_expert.down_proj.weight.shape[1] * self.shared_expert.down_proj.tp_size
            shapes[f"{p}shared_expert.gate_proj.weight"] = shapes[f"{p}shared_expert.up_proj.weight"] = (shared, hidden)
            shapes[f"{p}shared_expert.down_proj.weight"] = (hidden, shared)
            shapes[f"{p}shared_expert_gate.weight"] = (1, hidden)
        return shapes


def is_sparse_layer(config, layer_index: int) -> bool:
    """transformers' rule for Qwen2-MoE / Qwen3-MoE."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_index not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
            and (layer_index + 1) % step == 0)


class MoeDecoderForCausalLM(DecoderForCausalLM):
    """The shared decoder whose sparse layers hold a SparseMoeBlock (make_mlp decides which)."""

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().checkpoint_shapes()
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                for name in [n for n in shapes if n.startswith(f"model.layers.{i}.mlp.")]:
                    del shapes[name]
                shapes.update(layer.mlp.checkpoint_shapes(f"model.layers.{i}."))
        return shapes


class Qwen3MoeForCausalLM(MoeDecoderForCausalLM):
    traits = FamilyTraits(qk_norm=True)

    @classmethod
    def make_mlp(cls, config, layer_index: int) -> nn.Module:
        if not is_sparse_layer(config, layer_index):
            return DecoderMLP(config)
        return SparseMoeBlock(config, config.num_experts, bool(config.norm_topk_prob), config.moe_intermediate_size)
