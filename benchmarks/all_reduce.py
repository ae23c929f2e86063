"""All-reduce latency of decode-sized tensors: NCCL against torch's symmetric-memory two-shot (the engine's) and
one-shot operations.

Run with one process per GPU; every call is captured in a CUDA graph, as a decode step replays it:

    torchrun --nproc-per-node 2 benchmarks/all_reduce.py --out results/all_reduce.json

Prints microseconds per all-reduce of [rows, hidden] bfloat16 for each way, and writes JSON (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

CALLS_PER_GRAPH = 50


def time_in_graph(reduce, x: torch.Tensor, replays: int = 20) -> float:
    """Microseconds per call of reduce(x), replayed from one CUDA graph of CALLS_PER_GRAPH calls."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up outside the graph (NCCL sets up its channels lazily)
            reduce(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            reduce(x)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * CALLS_PER_GRAPH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256, 512])
    parser.add_argument("--out", default="results/all_reduce.json")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    from nanovllm.distributed.symmetric_all_reduce import SymmetricAllReduce

    reducer = SymmetricAllReduce.create(device)
    if reducer is None:
        raise SystemExit("symmetric-memory all-reduce is unavailable here")
    ways = {
        "nccl": lambda t: dist.all_reduce(t),
        # the engine's operation: the tensor summed in place in the shared buffer
        "two-shot": lambda t: reducer.reduce_shared(reducer.shared_output(t.shape, t.dtype)),
        # torch's alternative, measured for comparison: each rank reads every peer's whole tensor
        "one-shot": lambda t: torch.ops.symm_mem.one_shot_all_reduce(reducer.shared_output(t.shape, t.dtype),
                                                                    "sum", reducer.group_name),
    }
    results = []
    for rows in args.rows:
        x = torch.randn(rows, args.hidden, dtype=torch.bfloat16, device=device)
        if reducer.shared_output(x.shape, x.dtype) is None:
            continue
        row = {"rows": rows, "hidden": args.hidden, "bytes": x.numel() * x.element_size(),
               "world_size": dist.get_world_size()}
        for name, way in ways.items():
            row[f"{name}_us"] = round(time_in_graph(way, x.clone()), 2)
        results.append(row)
    if dist.get_rank() == 0:
        print(f"{'rows':>6}{'MiB':>8}" + "".join(f"{name + ' us':>14}" for name in ways))
        for r in results:
            print(f"{r['rows']:>6}{r['bytes'] / 2**20:>8.2f}" + "".join(f"{r[name + '_us']:>14.2f}" for name in ways))
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    reducer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
