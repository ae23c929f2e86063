"""An fp8 checkpoint's per-layer KV cache scales (`self_attn.k_scale` / `v_scale`): read at load, used by an fp8
cache, ignored by others; a malformed one is refused by name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from nanovllm import LLM, SamplingParams
from tests.helpers import save_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 5, 9, 22, 7], [3, 3, 40, 2]]
ENGINE = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=128)


def _with_scales(tmp_path, scales: dict[str, torch.Tensor]) -> str:
    path = save_tiny_model("llama", tmp_path / "model")
    save_file(scales, str(tmp_path / "model" / "kv_scales.safetensors"))
    return path


def test_checkpoint_scales_reach_an_fp8_cache(tmp_path) -> None:
    layers = 2  # tiny_config's
    k_scales, v_scales = [0.02 * (i + 1) for i in range(layers)], [0.005 * (i + 1) for i in range(layers)]
    scales = {f"model.layers.{i}.self_attn.k_scale": torch.tensor(k_scales[i]) for i in range(layers)}
    scales |= {f"model.layers.{i}.self_attn.v_scale": torch.tensor(v_scales[i]) for i in range(layers)}
    path = _with_scales(tmp_path, scales)
    fp8 = LLM(path, kv_cache_dtype="fp8", **ENGINE)
    attention = fp8.runner.model.attention_layers()
    assert len(attention) == layers
    assert [a.k_scale for a in attention] == pytest.approx(k_scales)
    assert [a.v_scale for a in attention] == pytest.approx(v_scales)
    plain = LLM(path, **ENGINE)
    assert all(a.k_scale == a.v_scale == 1.0 for a in plain.runner.model.attention_layers())
    prefill = SamplingParams(temperature=0, max_tokens=1)
    for llm in (fp8, plain):  # the prompts' K/V alone in each cache
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], prefill, use_tqdm=False)
    for i in range(layers):  # the cache holds K / k_scale and V / v_scale
        for kind, scale in ((0, k_scales[i]), (1, v_scales[i])):
            stored = fp8.runner.kv_cache[kind, i].float().abs().max().item() * scale
            true = plain.runner.kv_cache[kind, i].float().abs().max().item()
            assert stored == pytest.approx(true, rel=2 ** -4), (kind, i, stored, true)
    out = [o.token_ids for o in fp8.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
    expected = [o.token_ids for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                    use_tqdm=False)]
    same = sum(a == b for x, y in zip(out, expected) for a, b in zip(x, y))
    assert [x[0] for x in out] == [y[0] for y in expected] and same >= 12, (out, expected)


@pytest.mark.parametrize("name, value, message", [
    ("model.layers.0.self_attn.k_scale", torch.tensor(0.0), "must be > 0"),
    ("model.layers.0.self_attn.v_scale", torch.ones(2), "one number on an attention layer"),
    ("model.layers.0.mlp.k_scale", torch.tensor(1.0), "one number on an attention layer"),
])
def test_malformed_scales_are_refused_by_name(tmp_path, name, value, message) -> None:
    path = _with_scales(tmp_path, {name: value})
    with pytest.raises(ValueError, match=message) as error:
        LLM(path, kv_cache_dtype="fp8", **ENGINE)
    assert name in str(error.value)
