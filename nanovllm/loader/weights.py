"""Fill a model's parameters from checkpoint tensors (safetensors folder, GGUF) or with random values."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator

import torch
from torch import nn

# checkpoint tensors that carry nothing we need
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# an fp8 checkpoint's per-layer KV cache scales (vLLM's names: `<layer>.self_attn.k_scale` / `v_scale`, or under
# `self_attn.attn.`): kept by the layer's attention, which uses them when its cache is fp8 (layers/attention.py)
KV_SCALE_NAMES = ("k_scale", "v_scale")


def iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model folder {folder!r}")
    for path in files:
        with safe_open(path, "pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _checkpoint_names(model: nn.Module) -> dict[str, tuple[str, object]]:
    """Every checkpoint tensor name the model expects -> (our parameter name, shard id)."""
    packed = getattr(model, "packed_modules_mapping", {})
    expected = {}
    for name, param in model.named_parameters():
        names_of = getattr(param, "checkpoint_names", None)
        if names_of is not None:  # filled from tensors named its own way (experts stacked from per-expert tensors)
            expected.update((ckpt_name, (name, shard_id)) for ckpt_name, shard_id in names_of(name).items())
            continue
        for ckpt_part, (our_part, shard_id) in packed.items():
            if f".{our_part}." in name:
                expected[name.replace(f".{our_part}.", f".{ckpt_part}.")] = (name, shard_id)
        if not any(f".{our_part}." in name for our_part, _ in packed.values()):
            expected[name] = (name, None)
    return expected


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """A replicated parameter takes the tensor whole."""
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a parameter of "
                         f"shape {tuple(param.shape)}")
    param.data.copy_(loaded)


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Copy each checkpoint tensor into its parameter through the parameter's weight_loader.

    Raises ValueError naming the first unexpected tensor, or every parameter the checkpoint left missing.
    """
    expected = _checkpoint_names(model)
    params = dict(model.named_parameters())
    tied = bool(getattr(model, "tie_word_embeddings", False))
    seen = set()
    for ckpt_name, tensor in tensors:
        if ckpt_name.endswith(IGNORED_SUFFIXES):
            continue
        if ckpt_name == "lm_head.weight" and tied:
            continue  # the LM head shares the embedding's weight
        if ckpt_name.rsplit(".", 1)[-1] in KV_SCALE_NAMES:
            _keep_kv_scale(model, ckpt_name, tensor, source)
            continue
        if ckpt_name not in expected:
            raise ValueError(f"unexpected tensor {ckpt_name!r} in {source}: the model has no such parameter")
        param_name, shard_id = expected[ckpt_name]
        param = params[param_name]
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"tensor {ckpt_name!r} in {source}: {e}") from None
        seen.add(ckpt_name)
    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(repr(m) for m in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"{len(missing)} tensor(s) missing from {source}: {shown}")


def _keep_kv_scale(model: nn.Module, ckpt_name: str, tensor: torch.Tensor, source: str) -> None:
    owner, kind = ckpt_name.rsplit(".", 1)
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        module = None
    attention = getattr(module, "attn", module)
    if not hasattr(attention, "checkpoint_kv_scales") or tensor.numel() != 1:
        raise ValueError(f"unexpected tensor {ckpt_name!r} {tuple(tensor.shape)} in {source}: a KV cache scale is "
                         f"one number on an attention layer")
    scale = float(tensor.float())
    if not scale > 0:  # also NaN
        raise ValueError(f"{ckpt_name!r} in {source} is {scale}: a KV cache scale must be > 0")
    attention.checkpoint_kv_scales[kind] = scale


def dummy_tensors(model: nn.Module, seed: int, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Random full-size checkpoint tensors: the same values whatever the tensor-parallel size, for a seed.

    Norm weights are 1, everything else small and centred, so activations stay sane through many layers.
    """
    generator = torch.Generator(device=device)
    for index, (name, shape) in enumerate(sorted(model.checkpoint_shapes().items())):
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, device=device)
        else:
            generator.manual_seed(seed * 1_000_003 + index)
            yield name, torch.empty(shape, device=device).uniform_(-0.04, 0.04, generator=generator)


def checkpoint_tensors(model: nn.Module, model_path: str, config, device: torch.device
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors to load, by the engine's load_format (auto: GGUF for a .gguf file, else safetensors)."""
    if config.load_format == "dummy":
        return dummy_tensors(model, config.seed, device)
    from nanovllm.loader.gguf import is_gguf, iter_gguf_tensors
    if config.load_format == "gguf" or (config.load_format == "auto" and is_gguf(model_path)):
        return iter_gguf_tensors(model_path, config.torch_dtype)
    return iter_safetensors(model_path)
