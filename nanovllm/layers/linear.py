"""Linear layers that shard themselves across tensor-parallel ranks as their weights load.

Every parameter carries a ``weight_loader(param, loaded, shard_id=None)`` that copies its slice of a full
checkpoint tensor, so the loader is one short loop whatever the parallelism or packing.
"""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.distributed.state import current_tensor_parallel, tp_size
from nanovllm.layers.linear_method import UNQUANTIZED


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator}).")
    return numerator // denominator


class LinearBase(nn.Module):
    """y = x W^T (+ b) through the layer's linear_method (layers/linear_method.py: F.linear on ``weight`` unless
    the platform chose another at load time); tp_dim says which dimension of W is split across ranks (None:
    replicated)."""

    tp_dim: int | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.tp = current_tensor_parallel()  # its engine's: another engine may share this process
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.linear_method = UNQUANTIZED
        self.output_size = output_size  # this rank's: the weight itself may be released into its method's format
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _shard(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        size = loaded.shape[dim] // self.tp_size
        return loaded.narrow(dim, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self.tp_dim is not None and (self.tp_dim == 0 or param.dim() > 1):
            loaded = self._shard(loaded, self.tp_dim)
        _copy_checked(param.data, loaded, param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, param) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} does not fit a parameter of "
                         f"shape {tuple(dst.shape)}")
    dst.copy_(src)


class ReplicatedLinear(LinearBase):
    tp_dim = None


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    tp_dim = 0

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, _divide(output_size, tp_size(), "output size"), bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections packed in one matmul (gate and up); shard_id = index of the part."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        assert shard_id is not None
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        _copy_checked(param.data.narrow(0, offset, size), self._shard(loaded, 0), param)

    def forward_silu_and_mul(self, x: torch.Tensor, act: nn.Module) -> torch.Tensor:
        """act(self(x)) for a [gate | up] pair and SwiGLU's act: one kernel where the linear method has one."""
        return self.linear_method.apply_silu_and_mul(self, x, self.bias, act)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul, split by heads; KV heads are replicated when ranks outnumber them."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        size = tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, size, "num_attention_heads")
        if num_kv_heads >= size:
            self.num_kv_heads = _divide(num_kv_heads, size, "num_key_value_heads")
        else:
            _divide(size, num_kv_heads, "tensor_parallel_size vs num_key_value_heads")
            self.num_kv_heads = 1
        self.total_num_kv_heads = num_kv_heads
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        assert shard_id in ("q", "k", "v")
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, index = 0, q_size, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size = kv_size
            # with replicated KV heads, consecutive ranks share one head
            index = self.tp_rank // max(self.tp_size // self.total_num_kv_heads, 1)
        _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, index * size, size), param)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced (the bias is added once, after)."""

    tp_dim = 1

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(_divide(input_size, tp_size(), "input size"), output_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        if self.tp_size == 1:
            return self.linear_method.apply(self, x, bias)
        reducer = self.tp.custom_all_reduce if x.is_cuda else None
        shared = reducer.shared_output((*x.shape[:-1], self.output_size), x.dtype) if reducer else None
        if shared is None:
            return self.tp.all_reduce(self.linear_method.apply(self, x, bias))
        # decode-sized: the partial sum goes straight into the buffer the ranks share, and the sum is read from
        # there (no copy in or out); it is valid until the next all-reduce, and the residual add + norm that
        # follows every row-parallel layer reads it before then
        if self.linear_method is UNQUANTIZED:
            torch.matmul(x, self.weight.t(), out=shared)
            if bias is not None:
                shared += bias
        else:  # another weight format (fp8): its own product, copied in
            shared.copy_(self.linear_method.apply(self, x, bias))
        return reducer.reduce_shared(shared)
