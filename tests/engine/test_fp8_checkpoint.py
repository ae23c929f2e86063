"""An HF fp8 checkpoint (quantization_config quant_method "fp8", e4m3 weights with block-wise weight_scale_inv, as
Qwen3-*-FP8): loaded exactly (on the CPU each weight is its blocks dequantized) and answering as the float
checkpoint of those dequantized weights does; malformed configurations are refused by name."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from tests.helpers import save_tiny_model

BLOCK = (48, 32)  # rows not a multiple of 48 leave a partial last block, as the checkpoint format allows
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1, 5, 9, 22, 7], [3, 3, 40, 2, 11, 60]]
ENGINE = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=128)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    grid = (-(-rows // BLOCK[0]), cols // BLOCK[1])
    padded = torch.zeros(grid[0] * BLOCK[0], cols)
    padded[:rows] = weight
    blocks = padded.view(grid[0], BLOCK[0], grid[1], BLOCK[1])
    scale = blocks.abs().amax(dim=(1, 3)) / 448
    values = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(-1, cols)[:rows]
    return values, scale


def _fp8_and_dequantized(tmp_path, quant_config: dict) -> tuple[str, str]:
    """The same tiny Qwen3 twice: as an fp8 checkpoint and as float32 weights equal to its dequantized blocks."""
    source = save_tiny_model("qwen3", tmp_path / "float")
    tensors = load_file(os.path.join(source, "model.safetensors"))
    fp8, dequantized = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED:
            values, scale = _quantize_blocks(tensor)
            fp8[name], fp8[name + "_scale_inv"] = values, scale
            rows = values.shape[0]
            dequantized[name] = values.float() * scale.repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(
                BLOCK[1], 1)
        else:
            fp8[name] = dequantized[name] = tensor
    paths = []
    for kind, state in (("fp8", fp8), ("dequantized", dequantized)):
        folder = tmp_path / kind
        folder.mkdir()
        save_file(state, str(folder / "model.safetensors"))
        with open(os.path.join(source, "config.json")) as f:
            config = json.load(f)
        if kind == "fp8":
            config["quantization_config"] = quant_config
        with open(folder / "config.json", "w") as f:
            json.dump(config, f)
        paths.append(str(folder))
    return paths[0], paths[1]


def test_fp8_checkpoint_loads_its_blocks_exactly(tmp_path) -> None:
    fp8_path, float_path = _fp8_and_dequantized(
        tmp_path, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": BLOCK})
    fp8, plain = LLM(fp8_path, **ENGINE), LLM(float_path, **ENGINE)
    ours = dict(fp8.runner.model.named_parameters())
    theirs = dict(plain.runner.model.named_parameters())
    assert ours.keys() == theirs.keys()  # the block scales are gone once folded in
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    batch = [{"prompt_token_ids": p} for p in PROMPTS]
    assert ([o.token_ids for o in fp8.generate(batch, GREEDY, use_tqdm=False)]
            == [o.token_ids for o in plain.generate(batch, GREEDY, use_tqdm=False)])


@pytest.mark.parametrize("quant_config, message", [
    ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": BLOCK, "activation_scheme": "static"}, "activation_scheme"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "not a multiple of the checkpoint's fp8 block"),
])
def test_unsupported_fp8_checkpoints_are_refused(tmp_path, quant_config, message) -> None:
    fp8_path, _ = _fp8_and_dequantized(tmp_path, quant_config)
    with pytest.raises(ValueError, match=message):
        LLM(fp8_path, **ENGINE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_checkpoint_on_the_gpu_multiplies_e4m3_blocks(tmp_path) -> None:
    """CUDA: the layers keep e4m3 weights and run the block-scaled GEMM; CUDA graphs and eager give the same
    tokens, and they are mostly the dequantized checkpoint's on the CPU."""
    fp8_path, float_path = _fp8_and_dequantized(
        tmp_path, {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": BLOCK})
    batch = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = [o.token_ids for o in LLM(float_path, **ENGINE).generate(batch, GREEDY, use_tqdm=False)]
    runs = []
    for eager in (True, False):
        gpu = LLM(fp8_path, device="cuda", dtype="bfloat16", enforce_eager=eager, kvcache_block_size=16,
                  num_kvcache_blocks=64, max_model_len=128)
        method = gpu.runner.model.model.layers[0].mlp.down_proj.linear_method
        assert method.weight.dtype == torch.float8_e4m3fn and method.scales.shape[1] == 128 // BLOCK[1]
        runs.append([o.token_ids for o in gpu.generate(batch, GREEDY, use_tqdm=False)])
    assert runs[0] == runs[1]
    same = sum(a == b for x, y in zip(runs[0], expected) for a, b in zip(x, y))
    assert same >= 0.75 * sum(map(len, expected)), (runs[0], expected)
