"""Weights asked into the L2 cache ahead of the products that read them (Hopper and later).

At a few rows a decode step is a chain of latency-bound kernels, and each product starts reading its weight from
HBM only when the kernel before it has finished. Between a layer's qkv projection and its o_proj the attention
reads little, so HBM idles there; a prefetch issued then can bring the layer's o_proj, gate_up and down weights
into L2 before their turn. It is one instruction per chunk (``cp.async.bulk.prefetch.L2``: the copy engine fetches
the bytes, the program moves on), spread over many programs so that the requests leave as fast as HBM serves them.

A plan is made once per layer from its weight tensors (their addresses do not move) and launched like the other
kernels of a step, overlapped with the kernel before it: it waits for that kernel first, so the chain of
dependencies a CUDA graph keeps is unbroken, and only then issues its requests.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.jit import INTERPRETED, num_sms, overlap_options, wait_for_prior_kernel

LANES = 32  # one chunk per thread of a single-warp program
MIN_CHUNK_BYTES = 4096


@functools.cache
def available(device: torch.device) -> bool:
    """The bulk L2 prefetch is sm_90's; a plan is only worth launching where kernels overlap their launches."""
    return (not INTERPRETED and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
            and "OVERLAP" in overlap_options(device))


def l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size


def chunk_bytes_for(total: int, programs: int) -> int:
    """About one chunk per lane of `programs` programs, a multiple of 16 bytes (the instruction's unit)."""
    per_lane = triton.cdiv(total, programs * LANES)
    return max(MIN_CHUNK_BYTES, triton.cdiv(per_lane, 16) * 16)


class PrefetchPlan(NamedTuple):
    chunks: torch.Tensor  # [2, chunks] int64: each chunk's address and bytes
    tensors: tuple[torch.Tensor, ...]  # kept alive: the addresses are theirs


def prefetch_plan(tensors: list[torch.Tensor], programs: int) -> PrefetchPlan:
    """The tensors cut into chunks of about equal size, about one per lane of `programs` programs, their chunks in
    the order given (a launch issues them in that order across its programs). Tensors must be contiguous and
    16-byte aligned."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    chunk = chunk_bytes_for(total, programs)
    addresses, sizes = [], []
    for t in tensors:
        assert t.is_contiguous() and t.data_ptr() % 16 == 0, "a prefetched tensor must be contiguous, 16-byte aligned"
        nbytes = t.numel() * t.element_size()
        assert nbytes % 16 == 0, f"a prefetched tensor's bytes must be a multiple of 16, got {nbytes}"
        for start in range(0, nbytes, chunk):
            addresses.append(t.data_ptr() + start)
            sizes.append(min(chunk, nbytes - start))
    chunks = torch.tensor([addresses, sizes], dtype=torch.int64, device=tensors[0].device)
    return PrefetchPlan(chunks, tuple(tensors))


@triton.jit
def _l2_prefetch_kernel(plan_ptr, num_chunks, OVERLAP: tl.constexpr, LANES: tl.constexpr):
    # wait first: a kernel that finished before its predecessor would let the next kernel's wait pass early
    wait_for_prior_kernel(OVERLAP)
    programs = tl.num_programs(0)
    chunk = tl.program_id(0) + tl.arange(0, LANES) * programs  # chunk i goes out in round i // programs
    mask = chunk < num_chunks
    address = tl.load(plan_ptr + chunk, mask=mask, other=0)
    size = tl.load(plan_ptr + num_chunks + chunk, mask=mask, other=0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred live; setp.ne.s32 live, $2, 0; @live cp.async.bulk.prefetch.L2.global [$1], $2; "
        "mov.b32 $0, 0; }",
        "=r,l,r", [address, size], dtype=tl.int32, is_pure=False, pack=1)


def plan_for_device(tensors: list[torch.Tensor]) -> PrefetchPlan:
    """prefetch_plan for one program per SM of the tensors' device."""
    return prefetch_plan(tensors, num_sms(tensors[0].device))


def l2_prefetch(plan: PrefetchPlan) -> None:
    """Issue a plan's chunks; returns at once, the bytes arrive in L2 while later kernels run."""
    num_chunks = plan.chunks.shape[1]
    programs = triton.cdiv(num_chunks, LANES)
    _l2_prefetch_kernel[(programs,)](plan.chunks, num_chunks, LANES=LANES, num_warps=1,
                                     **overlap_options(plan.chunks.device))
