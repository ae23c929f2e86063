"""Tune the fused-MoE kernels' block sizes per batch size on this GPU; writes the table the engine reads.

    python benchmarks/tune_fused_moe.py --model benchmarks/model_configs/qwen3-30b-a3b \
        --out nanovllm/kernels/fused_moe_table.json

For each batch size (tokens per call) every candidate (block_m, block_n, block_k, num_warps, num_stages) is
timed as benchmarks/fused_moe.py times a call (CUDA-graph replays over several weight copies) and the fastest
kept. Candidates are tried most plausible first, and a batch size stops at its share of --max-seconds, so a short
budget still leaves a sensible entry. The output merges into the table already at --out (or the package's),
under this device's name and the shape's key (kernels/fused_moe.py: table_key).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.fused_moe import MoeProblem, moe_shape, time_per_call  # noqa: E402

BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def candidates(num_tokens: int, top_k: int, num_experts: int) -> list[tuple[int, int, int, int, int]]:
    """(block_m, block_n, block_k, num_warps, num_stages) in a fixed shuffled order, so that a budget cut short
    has still seen many tile shapes. Rows per expert decide the space: a few rows (decode) want the smallest
    row block (the call is a weight read), many want big tiles (FLOPs)."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 4:
        space = itertools.product([16], [64, 128, 32], [128, 256, 64], [4, 8], [3, 4, 2])
    elif rows_per_expert <= 64:
        space = itertools.product([16, 32, 64], [64, 128], [128, 64, 256], [4, 8], [3, 4])
    else:
        space = itertools.product([64, 128, 32], [128, 64, 256], [64, 128], [4, 8], [3, 4])
    space = list(space)
    random.Random(0).shuffle(space)
    return space


def format_table(table: dict) -> str:
    """JSON with one line per batch size, the sizes in numeric order."""
    ordered = {device: {key: dict(sorted(sizes.items(), key=lambda kv: int(kv[0]))) for key, sizes in sorted(shapes.items())}
               for device, shapes in sorted(table.items())}
    text = json.dumps(ordered, indent=1)
    return re.sub(r"\[\s+([^\[\]]*?)\s+\]", lambda m: "[" + ", ".join(v.strip() for v in m.group(1).split(",")) + "]",
                  text) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join(os.path.dirname(__file__), "model_configs", "qwen3-30b-a3b"))
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="tune the per-rank intermediate size")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=BATCH_SIZES)
    parser.add_argument("--max-seconds", type=float, default=240.0, help="the whole search's budget")
    parser.add_argument("--layers", type=int, default=3, help="weight copies per timed graph")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", required=True, help="the table to write (merged with what it already holds)")
    parser.add_argument("--smoke", action="store_true", help="no GPU: a tiny shape under the Triton interpreter, "
                        "two batch sizes, to check the script runs")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    from nanovllm.kernels.fused_moe import TABLE_PATH, MoeBlockConfig, default_block_config, table_key

    if args.smoke:
        shape, dtype, device, device_name = dict(num_experts=8, top_k=2, hidden=64, intermediate=32), torch.float32, \
            torch.device("cpu"), "cpu"
        args.batch_sizes, args.layers, args.reps, args.max_seconds = [1, 64], 1, 1, 4.0
    else:
        shape, dtype, device = moe_shape(args.model, args.tensor_parallel_size), torch.bfloat16, torch.device("cuda")
        device_name = torch.cuda.get_device_name(device)
    source = args.out if os.path.exists(args.out) else TABLE_PATH
    table = json.load(open(source)) if os.path.exists(source) else {}
    key = table_key(shape["num_experts"], shape["intermediate"], shape["hidden"], dtype)
    entries = table.setdefault(device_name, {}).setdefault(key, {})
    share = args.max_seconds / len(args.batch_sizes)
    print(f"{device_name}, {key}; {share:.0f} s per batch size")
    report = {}
    for size in args.batch_sizes:
        problem = MoeProblem(size, **shape, dtype=dtype, device=device, layers=args.layers)
        default = default_block_config(size)
        baseline = time_per_call(problem, default, args.reps)
        best, best_seconds, tried, start = default, baseline, 0, time.perf_counter()
        for candidate in candidates(size, shape["top_k"], shape["num_experts"]):
            if time.perf_counter() - start > share:
                break
            config = MoeBlockConfig(*candidate)
            try:
                seconds = time_per_call(problem, config, args.reps)
            except Exception as e:  # out of shared memory or registers for this tile: not a candidate here
                print(f"  {size}: {candidate} failed ({type(e).__name__})")
                continue
            tried += 1
            if seconds < best_seconds:
                best, best_seconds = config, seconds
        entries[str(size)] = list(best)
        report[size] = dict(config=list(best), microseconds=round(best_seconds * 1e6, 1),
                            default_microseconds=round(baseline * 1e6, 1), tried=tried)
        print(f"{size:>6} tokens: {list(best)} {best_seconds * 1e6:9.1f} us (default {list(default)} "
              f"{baseline * 1e6:.1f} us; {tried} tried)", flush=True)
        del problem
        if device.type == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(format_table(table))
    with open(os.path.splitext(args.out)[0] + "_report.json", "w") as f:
        json.dump(dict(device=device_name, key=key, results=report), f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
