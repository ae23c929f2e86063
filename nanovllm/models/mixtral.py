"""Mixtral: Llama's attention; every layer's MLP is a mixture of experts (w1 gate, w3 up, w2 down), the top-k
routing weights always renormalised; the checkpoint calls the block ``block_sparse_moe``."""

from __future__ import annotations

from torch import nn

from nanovllm.models.decoder import FamilyTraits
from nanovllm.models.qwen3_moe import MoeDecoderForCausalLM, SparseMoeBlock


class MixtralForCausalLM(MoeDecoderForCausalLM):
    traits = FamilyTraits()

    @classmethod
    def make_mlp(cls, config, layer_index: int) -> nn.Module:
        return SparseMoeBlock(config, config.num_local_experts, True, config.intermediate_size,
                              expert_names=("w1", "w3", "w2"), module_name="block_sparse_moe")
