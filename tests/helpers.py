"""Shared test helpers: tiny random Hugging Face models and a greedy reference decoder."""

from __future__ import annotations

import torch

TINY_COMMON = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
)


def tiny_config(family: str, **overrides):
    from transformers import (
        LlamaConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    kw = dict(TINY_COMMON)
    if family == "qwen3_moe":
        # 8 experts, top-2; layer 1 keeps the dense MLP (mlp_only_layers), layers 0, 2 and 3 are sparse
        kw.update(head_dim=32, num_hidden_layers=4, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                  norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1)
        cls = Qwen3MoeConfig
    elif family == "qwen2_moe":
        kw.update(num_hidden_layers=3, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                  num_experts_per_tok=2, decoder_sparse_step=2)  # layer 1 sparse, layers 0 and 2 dense
        cls = Qwen2MoeConfig
    elif family == "mixtral":
        kw.update(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
        cls = MixtralConfig
    elif family == "qwen3":
        kw.update(head_dim=32)
        cls = Qwen3Config
    elif family == "qwen2":
        cls = Qwen2Config
    elif family == "llama":
        kw.update(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
                  rope_theta=500000.0)
        cls = LlamaConfig
    else:
        raise ValueError(family)
    kw.update(overrides)
    return cls(**kw)


def save_tiny_model(family: str, path, seed: int = 0, **overrides) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # larger-than-default weights make the logits decisive, so greedy ties cannot flip on rounding
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
    model.save_pretrained(str(path))
    return str(path)


def hf_greedy(model_path: str, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens from transformers and each prompt's last-token logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return hf_greedy_model(model, prompts, max_new_tokens)


@torch.no_grad()
def hf_greedy_model(model, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decoding with transformers' own KV cache; EOS does not stop it (as ignore_eos)."""
    model.eval()
    device = next(model.parameters()).device
    outs, first_logits = [], []
    for prompt in prompts:
        out = model(torch.tensor([prompt], device=device), use_cache=True)
        generated = []
        for step in range(max_new_tokens):
            logits = out.logits[0, -1]
            if step == 0:
                first_logits.append(logits)
            generated.append(int(logits.argmax()))
            out = model(torch.tensor([[generated[-1]]], device=device), past_key_values=out.past_key_values,
                        use_cache=True)
        outs.append(generated)
    return outs, first_logits
