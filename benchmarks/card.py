"""The ceilings of the card a benchmark runs on, measured in the same process: the device-to-device copy
(bytes read + written per second, what a kernel that streams its inputs once can approach) and a large bf16
matmul. The workloads' recorded ceilings are an H200's; on another card these say where the engine stands on
the card itself."""

from __future__ import annotations

# measured on the H200 of the workloads' recorded figures (docs/benchmarks.md, ../shared/workloads.md)
H200_COPY_BANDWIDTH = 4.25e12  # bytes/s, read + write
H200_MATMUL_FLOPS = 774e12  # bf16 dense, 8192^3


def copy_bandwidth_tbps(time_ms, device: str) -> float:
    """A 1 GiB device-to-device copy timed by time_ms(fn) (milliseconds): bytes read + written, TB/s."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (time_ms(lambda: dst.copy_(src)) * 1e-3) / 1e12


def _median_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def measured_copy_bandwidth() -> float | None:
    """This card's device-to-device copy (read + write) in bytes/s; None off CUDA. Run it before an engine takes
    the card's memory (it needs 2 GiB)."""
    import torch

    if not torch.cuda.is_available():
        return None
    tbps = copy_bandwidth_tbps(_median_ms, "cuda")
    torch.cuda.empty_cache()
    return tbps * 1e12


def measured_matmul_flops(size: int = 8192) -> float | None:
    """This card's bf16 size^3 matmul in FLOP/s; None off CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    ms = _time_matmul(size)
    torch.cuda.empty_cache()
    return 2 * size ** 3 / (ms * 1e-3)


def _time_matmul(size: int) -> float:
    import torch

    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(a)
    return _median_ms(lambda: torch.matmul(a, b, out=out))
