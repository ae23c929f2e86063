"""Model families, chosen by the config's ``architectures``."""

from __future__ import annotations

from nanovllm.models.decoder import DecoderForCausalLM, FamilyTraits
from nanovllm.models.mixtral import MixtralForCausalLM
from nanovllm.models.qwen2_moe import Qwen2MoeForCausalLM
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    traits = FamilyTraits()


class Qwen2ForCausalLM(DecoderForCausalLM):
    traits = FamilyTraits(qkv_bias=True, o_bias_from_config=False)


class Qwen3ForCausalLM(DecoderForCausalLM):
    traits = FamilyTraits(qk_norm=True)


MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # Llama's layers; sliding windows are handled by capping max_model_len
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


# a config without `architectures` is recognised by its model_type
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
               "mixtral": "MixtralForCausalLM"}


def model_class(config) -> type[DecoderForCausalLM]:
    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures and getattr(config, "model_type", None) in MODEL_TYPES:
        architectures = [MODEL_TYPES[config.model_type]]
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(f"unsupported model architecture {architectures or '(none given)'}; "
                     f"supported: {', '.join(sorted(MODEL_REGISTRY))}.")
