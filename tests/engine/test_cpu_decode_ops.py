"""The CPU's leaner decode ops equal their references: RoPE in three ops (q and k in one go), RMSNorm in one
call, decode attention over a lone request's K/V read in place, and with no mask when nothing is padding."""

import pytest
import torch

from nanovllm.attention.reference import decode_attention_ref
from nanovllm.layers.norm import RMSNorm, add_rms_norm, rms_norm
from nanovllm.layers.rotary import RotaryEmbedding, _rotate
from nanovllm.platforms.cpu.attention import decode_attention_cpu, decode_plan
from nanovllm.platforms.cpu.layers import CpuRMSNorm, CpuRotaryEmbedding
from tests.helpers import tiny_config


def reference_rotary(rotary: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return _rotate(x, rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1))


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_rotate_cpu_matches_rotate_half_on_a_packed_qkv(num_tokens):
    config = tiny_config("llama")  # llama3-scaled frequencies
    num_heads, num_kv_heads = 9, 3
    head_dim = config.hidden_size // config.num_attention_heads
    rotary = CpuRotaryEmbedding(RotaryEmbedding(config, head_dim, 512))
    positions = torch.randint(0, 512, (num_tokens,))
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    # q and k heads side by side in the fused projection: a strided view, rotated in one call
    qk = qkv[:, :(num_heads + num_kv_heads) * head_dim].view(num_tokens, -1, head_dim)
    out = rotary.rotate(positions, qk)
    torch.testing.assert_close(out, reference_rotary(rotary, positions, qk), atol=1e-6, rtol=1e-6)
    q_out, k_out = rotary.rotate_qk(positions, qk, num_heads)
    assert torch.equal(q_out, out[:, :num_heads]) and torch.equal(k_out, out[:, num_heads:])
    # forward (separate q and k) takes the same path; a new positions tensor must not reuse the cached tables
    q, k = qk[:, :num_heads], qk[:, num_heads:]
    other = (positions + 1) % 512
    q_out, k_out = rotary(other, q, k)
    torch.testing.assert_close(q_out, reference_rotary(rotary, other, q), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out, reference_rotary(rotary, other, k), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rows", [1, 7])
def test_rms_norm_on_the_cpu_equals_the_reference(rows):
    norm = CpuRMSNorm(RMSNorm(96, 1e-6))
    norm.weight.data = torch.randn(96)
    x, residual = torch.randn(rows, 96) * 3, torch.randn(rows, 96)
    torch.testing.assert_close(norm(x), rms_norm.__wrapped__(x, norm.weight, 1e-6), atol=1e-6, rtol=1e-6)
    out, summed = norm(x, residual)
    ref_out, ref_summed = add_rms_norm.__wrapped__(x, residual, norm.weight, 1e-6)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    assert torch.equal(summed, ref_summed)


@pytest.mark.parametrize("seq_len, block_size", [(1, 16), (37, 16), (300, 256), (64, 64)])
def test_lone_request_reads_its_kv_in_place(seq_len, block_size):
    num_heads, num_kv_heads, head_dim = 9, 3, 32
    num_blocks = 2 * ((seq_len + block_size - 1) // block_size) + 4
    g = torch.Generator().manual_seed(seq_len)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    width = (seq_len + block_size - 1) // block_size
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    q = torch.randn(1, num_heads, head_dim, generator=g)
    consecutive = torch.arange(3, 3 + width, dtype=torch.int32)[None]
    scattered = torch.randperm(num_blocks, generator=g)[:width].int()[None]
    if width > 1:
        scattered[0, 1] = scattered[0, 0] + 2  # never consecutive
    for tables, in_place in ((consecutive, True), (scattered, width == 1)):
        plan = decode_plan(tables, seq_lens, seq_len, block_size, [seq_len])
        assert (plan.first_slot is not None) == in_place and plan.valid is None
        out = decode_attention_cpu(q, k_cache, v_cache, plan, 0.2)
        ref = decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 0.2)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_batch_of_equal_lengths_needs_no_mask_and_a_ragged_one_does():
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 8
    k_cache, v_cache = torch.randn(40, block_size, num_kv_heads, head_dim), torch.randn(40, block_size, num_kv_heads,
                                                                                         head_dim)
    tables = torch.randperm(40)[:12].view(4, 3).int()
    q = torch.randn(4, num_heads, head_dim)
    for lens in ([20, 20, 20, 20], [20, 3, 17, 9]):
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        plan = decode_plan(tables, seq_lens, max(lens), block_size, lens)
        assert (plan.valid is None) == (min(lens) == max(lens)) and plan.first_slot is None
        out = decode_attention_cpu(q, k_cache, v_cache, plan, 0.25)
        torch.testing.assert_close(out, decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 0.25),
                                   atol=1e-5, rtol=1e-5)


def test_a_cpu_model_gets_the_cpu_layers_once_and_keeps_its_weights(tiny_qwen3) -> None:
    """layers/ keeps one device-agnostic forward each; a loaded CPU model's norms, activations and its one shared
    rotary are replaced by the CPU's versions (platforms/cpu/layers.py), which read the same weights and tables."""
    from nanovllm import LLM
    from nanovllm.layers.activation import SiluAndMul
    from nanovllm.platforms.cpu.layers import CpuSiluAndMul, use_cpu_layers

    llm = LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=16)
    model = llm.runner.model
    layers = model.model.layers
    assert all(type(m) in (CpuRMSNorm, CpuSiluAndMul, CpuRotaryEmbedding) for m in model.modules()
               if isinstance(m, (RMSNorm, SiluAndMul, RotaryEmbedding)))
    assert len({id(layer.self_attn.rotary) for layer in layers}) == 1, "one rotary, still shared"
    state = {name: tensor for name, tensor in model.state_dict().items()}
    assert use_cpu_layers(model) == 0, "nothing left to replace"
    plain = RMSNorm(model.model.norm.weight.shape[0], model.model.norm.eps)
    plain.weight = model.model.norm.weight
    x = torch.randn(3, plain.weight.shape[0])
    torch.testing.assert_close(model.model.norm(x), plain(x), atol=1e-6, rtol=1e-6)
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())
    llm.close()
