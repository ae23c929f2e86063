"""Mixture-of-experts layers: the top-k router and the experts stacked into [experts, ...] parameters.

Checkpoints store each expert's projections apart (``experts.{i}.gate_proj.weight`` ...); the stacked
parameters carry a ``checkpoint_names`` function beside their ``weight_loader``, so the loader knows which
tensors fill them and each tensor lands in its expert's slice. Tensor parallelism: every rank holds every
expert, with its slice of the intermediate dimension (the gate/up rows, the down columns), and the experts'
partial sums are all-reduced once, as the dense MLP's down projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed.state import current_tensor_parallel
from nanovllm.kernels.fused_moe_reference import fused_moe_reference


def checkpoint_name(name: str, module_name: str) -> str:
    """Our name of a tensor in a layer's ``mlp`` -> the checkpoint's, whose block may be named otherwise."""
    return name if module_name == "mlp" else name.replace(".mlp.", f".{module_name}.", 1)


class TopKRouter(nn.Module):
    """Router logits in the model's dtype, softmax in float32, the top_k experts, renormalised to sum to 1
    when asked (Qwen3-MoE's norm_topk_prob, Mixtral always); the weights come back in the model's dtype."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_experts ({num_experts}).")
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [num_tokens, hidden] -> (weights [num_tokens, top_k], expert ids [num_tokens, top_k])."""
        logits = F.linear(hidden, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids


class FusedExperts(nn.Module):
    """Every expert's SwiGLU MLP in two stacked parameters, run through one fused path.

    w13_weight: [experts, 2 * intermediate / tp, hidden] (this rank's gate rows, then its up rows);
    w2_weight: [experts, hidden, intermediate / tp]. names: the checkpoint's (gate, up, down) projection names;
    module_name: what the checkpoint calls the block our layers call ``mlp`` (Mixtral: block_sparse_moe).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), module_name: str = "mlp"):
        super().__init__()
        self.tp = current_tensor_parallel()  # its engine's: another engine may share this process
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        if intermediate_size % self.tp_size:
            raise ValueError(f"moe_intermediate_size ({intermediate_size}) is not divisible by "
                             f"tensor_parallel_size ({self.tp_size}).")
        self.num_experts, self.names, self.module_name = num_experts, names, module_name
        self.intermediate = intermediate_size // self.tp_size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate), requires_grad=False)
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader
            param.checkpoint_names = self.checkpoint_names
        self._device_name: str | None = None

    def checkpoint_names(self, param_name: str) -> dict[str, tuple[int, int]]:
        """The checkpoint tensors that fill a stacked parameter -> shard id (expert, 0 gate | 1 up | 2 down)."""
        prefix = checkpoint_name(param_name.rsplit(".", 1)[0], self.module_name)
        parts = (0, 1) if param_name.endswith("w13_weight") else (2,)
        return {f"{prefix}.{e}.{self.names[part]}.weight": (e, part) for e in range(self.num_experts) for part in parts}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]) -> None:
        expert, part = shard_id
        size = self.intermediate
        if part == 2:  # down: [hidden, intermediate], this rank's columns
            target, source = param.data[expert], loaded.narrow(1, self.tp_rank * size, size)
        else:  # gate / up: [intermediate, hidden], this rank's rows into the gate or the up half
            target = param.data[expert].narrow(0, part * size, size)
            source = loaded.narrow(0, self.tp_rank * size, size)
        if target.shape != source.shape:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit expert {expert} of a "
                             f"parameter of shape {tuple(param.shape)}")
        target.copy_(source)

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """hidden: [num_tokens, hidden]; topk_*: [num_tokens, top_k] -> [num_tokens, hidden], summed over ranks."""
        if hidden.is_cuda:
            from nanovllm.kernels.fused_moe import fused_moe, pick_block_config
            if self._device_name is None:
                self._device_name = torch.cuda.get_device_name(hidden.device)
            config = pick_block_config(hidden.shape[0], self.num_experts, self.intermediate, hidden.shape[1],
                                       hidden.dtype, self._device_name)
            out = fused_moe(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, config)
        else:
            out = fused_moe_reference(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return self.tp.all_reduce(out) if self.tp_size > 1 else out
