"""Microbenchmark of the fused-MoE kernels: % of copy bandwidth at decode sizes, % of bf16 peak at prefill sizes.

    python benchmarks/fused_moe.py --model benchmarks/model_configs/qwen3-30b-a3b --out results/fused_moe.json
    python benchmarks/fused_moe.py --smoke --out /tmp/fused_moe.json     # CPU interpreter, tiny shapes

One call = the whole MoE feed-forward of one layer (alignment, gate/up + SiLU-and-mul, down + routing weight,
sum over the chosen experts) for M tokens with random top-k routing. It is timed as CUDA-graph replays of
``--layers`` calls over different weight copies, as consecutive layers of a model, so the L2 cache cannot hold a
layer's experts from one call to the next. Bytes = the weights of the distinct experts the routing hit + the
activations read and written; FLOPs = 2 * M * top_k * 3 * hidden * intermediate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

COPY_BANDWIDTH = 4.25e12  # H200 device-to-device copy, bytes/s (read + write)
MATMUL_FLOPS = 774e12  # H200 bf16 dense matmul
DECODE_SIZES = [1, 8, 32, 64, 128, 256]
PREFILL_SIZES = [1024, 4096, 16384]


def moe_shape(model: str, tp: int) -> dict:
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    experts = config.get("num_experts") or config["num_local_experts"]
    intermediate = config.get("moe_intermediate_size") or config["intermediate_size"]
    return dict(num_experts=experts, top_k=config["num_experts_per_tok"], hidden=config["hidden_size"],
                intermediate=intermediate // tp)


class MoeProblem:
    """M tokens routed to top_k of num_experts at random, and `layers` copies of the expert weights."""

    def __init__(self, num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int, dtype,
                 device, layers: int = 4, seed: int = 0):
        import torch

        g = torch.Generator(device=device).manual_seed(seed)
        self.num_tokens, self.top_k, self.hidden, self.intermediate = num_tokens, top_k, hidden, intermediate
        self.num_experts, self.itemsize = num_experts, torch.empty((), dtype=dtype).element_size()
        self.hidden_states = torch.randn(num_tokens, hidden, generator=g, device=device).to(dtype)
        self.w13 = [(torch.randn(num_experts, 2 * intermediate, hidden, generator=g, device=device) / hidden ** 0.5
                     ).to(dtype) for _ in range(layers)]
        self.w2 = [(torch.randn(num_experts, hidden, intermediate, generator=g, device=device) / intermediate ** 0.5
                    ).to(dtype) for _ in range(layers)]
        logits = torch.randn(num_tokens, num_experts, generator=g, device=device)
        weights, self.topk_ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
        self.topk_weights = weights.to(dtype)

    @property
    def distinct_experts(self) -> int:
        return int(self.topk_ids.unique().numel())

    def bytes_moved(self) -> int:
        weights = self.distinct_experts * 3 * self.hidden * self.intermediate
        rows = self.num_tokens * self.top_k
        # hidden in, [rows, I] activations written and read, [rows, H] expert outputs written and read, out written
        activations = 2 * self.num_tokens * self.hidden + 2 * rows * self.intermediate + 2 * rows * self.hidden
        return (weights + activations) * self.itemsize

    def flops(self) -> int:
        return 2 * self.num_tokens * self.top_k * 3 * self.hidden * self.intermediate


def time_per_call(problem: MoeProblem, config=None, reps: int = 10) -> float:
    """Seconds per layer-call: CUDA-graph replays of one call per weight copy (eager where there is no GPU)."""
    import torch

    from nanovllm.kernels.fused_moe import fused_moe

    def calls():
        for w13, w2 in zip(problem.w13, problem.w2):
            fused_moe(problem.hidden_states, w13, w2, problem.topk_weights, problem.topk_ids, config)

    calls()  # compile
    if not problem.hidden_states.is_cuda:
        import time
        start = time.perf_counter()
        calls()
        return (time.perf_counter() - start) / len(problem.w13)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / (reps * len(problem.w13))
    del graph
    return seconds


def measure(problem: MoeProblem, config=None, reps: int = 10) -> dict:
    seconds = time_per_call(problem, config, reps)
    return dict(tokens=problem.num_tokens, distinct_experts=problem.distinct_experts, microseconds=round(seconds * 1e6, 1),
                bandwidth_tb_s=round(problem.bytes_moved() / seconds / 1e12, 3),
                fraction_of_copy_bandwidth=round(problem.bytes_moved() / seconds / COPY_BANDWIDTH, 3),
                tflop_s=round(problem.flops() / seconds / 1e12, 1),
                fraction_of_bf16_peak=round(problem.flops() / seconds / MATMUL_FLOPS, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join(os.path.dirname(__file__), "model_configs", "qwen3-30b-a3b"))
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="the per-rank intermediate size")
    parser.add_argument("--sizes", type=int, nargs="+", default=DECODE_SIZES + PREFILL_SIZES)
    parser.add_argument("--layers", type=int, default=4, help="weight copies per timed graph (defeats the L2)")
    parser.add_argument("--smoke", action="store_true", help="no GPU: tiny shapes under the Triton interpreter")
    parser.add_argument("--out", default="results/fused_moe.json")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    if args.smoke:
        shape, device, dtype, sizes = dict(num_experts=8, top_k=2, hidden=64, intermediate=32), "cpu", torch.float32, [1, 16]
    else:
        shape, device, dtype, sizes = moe_shape(args.model, args.tensor_parallel_size), "cuda", torch.bfloat16, args.sizes
    rows = []
    print(f"shape {shape}, {dtype}")
    print(f"{'tokens':>7}{'experts hit':>12}{'us':>10}{'TB/s':>8}{'% copy':>8}{'TFLOP/s':>9}{'% bf16':>8}")
    for size in sizes:
        problem = MoeProblem(size, **shape, dtype=dtype, device=device, layers=1 if args.smoke else args.layers)
        row = measure(problem)
        rows.append(row)
        print(f"{size:>7}{row['distinct_experts']:>12}{row['microseconds']:>10.1f}{row['bandwidth_tb_s']:>8.2f}"
              f"{row['fraction_of_copy_bandwidth']:>8.1%}{row['tflop_s']:>9.1f}{row['fraction_of_bf16_peak']:>8.1%}")
        del problem
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(shape=shape, dtype=str(dtype), results=rows), f, indent=2)


if __name__ == "__main__":
    main()
