"""The decoder-only transformer shared by the Llama, Qwen2 and Qwen3 families.

A family is this model with a few switches (QKV bias, per-head q/k RMSNorm). Parameter names follow the
Hugging Face checkpoints, except the packed ``qkv_proj`` and ``gate_up_proj`` (see ``packed_modules_mapping``).
Nothing here knows about tensor parallelism beyond using the parallel layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.norm import RMSNorm
from nanovllm.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class FamilyTraits:
    qkv_bias: bool = False  # bias on q/k/v (Qwen2), else the config's attention_bias
    o_bias_from_config: bool = True  # o_proj bias follows attention_bias (Llama, Qwen3) or is off (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, config, traits: FamilyTraits, rotary: RotaryEmbedding):
        super().__init__()
        head_dim = head_dim_of(config)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, num_heads, num_kv_heads,
                                          bias=traits.qkv_bias or attention_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size,
                                        bias=attention_bias and traits.o_bias_from_config)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.rotary = rotary
        if traits.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if self.attn.fuses_qkv(self.rotary, qkv):
            # one kernel for q/k norm, RoPE and the KV store
            out = self.attn.forward_qkv(qkv, positions, self.rotary, self.q_norm, self.k_norm)
            return self.o_proj(out.flatten(1, -1))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        v = qkv[:, q_size + kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q and k sit side by side in qkv: the rotary may rotate both in one go
            qk = qkv[:, :q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = self.rotary.rotate_qk(positions, qk, self.num_heads)
        else:
            q = self.q_norm(qkv[:, :q_size].view(-1, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, q_size:q_size + kv_size].view(-1, self.num_kv_heads, self.head_dim))
            q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v)
        return self.o_proj(out.flatten(1, -1))


class DecoderMLP(nn.Module):
    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported; supported: 'silu'.")
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x, self.act))


class DecoderLayer(nn.Module):
    def __init__(self, config, traits: FamilyTraits, rotary: RotaryEmbedding, mlp: nn.Module):
        super().__init__()
        self.self_attn = DecoderAttention(config, traits, rotary)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def quantize_norm_outputs(model: nn.Module) -> int:
    """After quantization="fp8": each RMSNorm whose rows only an e4m3-multiplying linear layer reads (a layer's
    input norm before qkv_proj; its post-attention norm before a dense MLP's gate_up_proj, not an MoE's router)
    hands that layer e4m3 rows (RMSNorm.e4m3_output); returns how many."""
    count = 0
    for layer in model.modules():
        if not isinstance(layer, DecoderLayer):
            continue
        pairs = [(layer.input_layernorm, layer.self_attn.qkv_proj)]
        if isinstance(layer.mlp, DecoderMLP):
            pairs.append((layer.post_attention_layernorm, layer.mlp.gate_up_proj))
        for norm, linear in pairs:
            if linear.linear_method.multiplies_e4m3_rows:
                norm.e4m3_output = True
                count += 1
    return count


class DecoderModel(nn.Module):
    def __init__(self, config, traits: FamilyTraits, max_position: int, make_mlp=None):
        """make_mlp(config, layer_index) -> the layer's feed-forward (default: the dense DecoderMLP)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # one table of cos/sin shared by every layer (a buffer, not a parameter: nothing to load)
        rotary = RotaryEmbedding(config, head_dim_of(config), max_position)
        make_mlp = make_mlp or (lambda config, index: DecoderMLP(config))
        self.layers = nn.ModuleList(DecoderLayer(config, traits, rotary, make_mlp(config, i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """input ids + positions -> hidden states; compute_logits on the rows that need a next token."""

    traits = FamilyTraits()
    # checkpoint name -> (our packed parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, max_position: int):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.traits, max_position, self.make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def make_mlp(cls, config, layer_index: int) -> nn.Module:
        """The feed-forward of one layer: dense here; a mixture-of-experts family decides per layer."""
        return DecoderMLP(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name and full (unsharded) shape of every tensor a checkpoint of this model holds."""
        c, traits = self.config, self.traits
        hd, heads = head_dim_of(c), c.num_attention_heads
        kv = getattr(c, "num_key_value_heads", None) or heads
        attention_bias = bool(getattr(c, "attention_bias", False))
        shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
                  "model.norm.weight": (c.hidden_size,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = {"q_proj": heads * hd, "k_proj": kv * hd, "v_proj": kv * hd}
            for name, rows in attn.items():
                shapes[f"{p}self_attn.{name}.weight"] = (rows, c.hidden_size)
                if traits.qkv_bias or attention_bias:
                    shapes[f"{p}self_attn.{name}.bias"] = (rows,)
            shapes[f"{p}self_attn.o_proj.weight"] = (c.hidden_size, heads * hd)
            if attention_bias and traits.o_bias_from_config:
                shapes[f"{p}self_attn.o_proj.bias"] = (c.hidden_size,)
            if traits.qk_norm:
                shapes[f"{p}self_attn.q_norm.weight"] = shapes[f"{p}self_attn.k_norm.weight"] = (hd,)
            shapes[f"{p}mlp.gate_proj.weight"] = shapes[f"{p}mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
            shapes[f"{p}mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
            shapes[f"{p}input_layernorm.weight"] = shapes[f"{p}post_attention_layernorm.weight"] = (c.hidden_size,)
        return shapes
