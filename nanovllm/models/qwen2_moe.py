"""Qwen2-MoE: Qwen2's attention (q/k/v bias); sparse layers add a shared expert behind a sigmoid gate."""

from __future__ import annotations

from torch import nn

from nanovllm.models.decoder import DecoderMLP, FamilyTraits
from nanovllm.models.qwen3_moe import MoeDecoderForCausalLM, SparseMoeBlock, is_sparse_layer


class Qwen2MoeForCausalLM(MoeDecoderForCausalLM):
    traits = FamilyTraits(qkv_bias=True, o_bias_from_config=False)

    @classmethod
    def make_mlp(cls, config, layer_index: int) -> nn.Module:
        if not is_sparse_layer(config, layer_index):
            return DecoderMLP(config)
        return SparseMoeBlock(config, config.num_experts, bool(config.norm_topk_prob), config.moe_intermediate_size,
                              shared_intermediate_size=config.shared_expert_intermediate_size)
