"""The scheduler's host time per step with each prefix-caching hash (xxh64, sha256): no model, the steps' tokens
are made up, so what is timed is Scheduler.schedule() + postprocess() (block allocation, prefix hashing and
matching, publishing) at N requests.

    python benchmarks/scheduler_hash.py --out results/scheduler_hash.json
    python benchmarks/scheduler_hash.py --num-requests 256 --block-sizes 16 256 --repeat 5 --out /tmp/s.json

Each request's prompt shares a system prefix with the others (so prefix hits happen) and then has its own tokens;
every request decodes ``--output-len`` tokens. A "prefill step" admits requests within the token budget (the
hashing of every full prompt block happens there), a "decode step" runs every request one token (a block is
hashed each time a request fills one). The algorithms run interleaved, round after round.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from nanovllm.engine.block_manager import BLOCK_HASHES
from nanovllm.engine.scheduler import Scheduler, SchedulerConfig
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--shared-prefix-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--algos", nargs="+", default=sorted(BLOCK_HASHES), choices=sorted(BLOCK_HASHES))
    parser.add_argument("--repeat", type=int, default=3, help="rounds; each round runs every algorithm once")
    parser.add_argument("--count-hashes", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def one_run(args: argparse.Namespace, block_size: int, algo: str) -> dict:
    rng = random.Random(0)
    shared = [rng.randrange(50_000) for _ in range(args.shared_prefix_len)]
    prompts = [shared + [rng.randrange(50_000) for _ in range(args.prompt_len - args.shared_prefix_len)]
               for _ in range(args.num_requests)]
    tokens_needed = args.num_requests * (args.prompt_len + args.output_len)
    scheduler = Scheduler(SchedulerConfig(
        max_num_seqs=args.num_requests, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.prompt_len + args.output_len + 1, num_kvcache_blocks=tokens_needed // block_size + 1024,
        kvcache_block_size=block_size, prefix_caching_hash_algo=algo), eos_token_ids={0})
    calls = [0]
    block_manager, hash_block = scheduler.block_manager, scheduler.block_manager.hash_block

    def counted(tokens, prefix_hash=-1):
        calls[0] += 1
        return hash_block(tokens, prefix_hash)

    if args.count_hashes:  # a separate pass: the counter's own cost would blur the timings
        block_manager.hash_block = counted
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for prompt in prompts:
        scheduler.add(Sequence(prompt, params, block_size=block_size))
    prefill, decode = [], []
    prefill_hashes = decode_hashes = 0
    while not scheduler.is_finished():
        before = calls[0]
        start = time.perf_counter()
        seqs = scheduler.schedule()
        is_prefill = any(s.is_prefill for s in seqs)
        token_ids = [rng.randrange(1, 50_000) if s.num_cached_tokens + s.num_scheduled_tokens == s.num_tokens
                     else None for s in seqs]
        scheduler.postprocess(seqs, token_ids)
        (prefill if is_prefill else decode).append(time.perf_counter() - start)
        if is_prefill:
            prefill_hashes += calls[0] - before
        else:
            decode_hashes += calls[0] - before
    return {"hashes_per_prefill_step": prefill_hashes / len(prefill), "hashes_per_decode_step": decode_hashes / len(decode),
            "block_size": block_size, "algo": algo, "prefill_steps": len(prefill), "decode_steps": len(decode),
            "prefill_ms_per_step": 1e3 * statistics.mean(prefill), "decode_ms_per_step": 1e3 * statistics.mean(decode),
            "total_s": sum(prefill) + sum(decode),
            "hit_tokens": scheduler.block_manager.num_hit_tokens}


def block_hash_us(algo: str, block_size: int, n: int = 20_000) -> float:
    tokens = list(range(block_size))
    fn = BLOCK_HASHES[algo]
    start = time.perf_counter()
    h = -1
    for _ in range(n):
        h = fn(tokens, h)
    return 1e6 * (time.perf_counter() - start) / n


def _span(stats: dict, digits: int = 2) -> str:
    return f"{stats['min']:.{digits}f}-{stats['max']:.{digits}f}"


def main() -> None:
    args = parse_args()
    runs = []
    for _ in range(args.repeat):
        for block_size in args.block_sizes:
            for algo in args.algos:
                runs.append(one_run(args, block_size, algo))
    hash_costs = {f"{algo}/{bs}": block_hash_us(algo, bs) for bs in args.block_sizes for algo in args.algos}
    # how many blocks a step hashes (the same for every algorithm): with the cost of one, the hash's share of a step
    args.count_hashes = True
    counts = {bs: one_run(args, bs, args.algos[0]) for bs in args.block_sizes}
    args.count_hashes = False
    print(f"{args.num_requests} requests x ({args.prompt_len} prompt, {args.shared_prefix_len} shared) + "
          f"{args.output_len} decoded; ms per step, min-max over {args.repeat} rounds")
    print(f"{'block':>6} {'algo':>7} {'prefill step':>16} {'decode step':>16} {'total s':>14} {'hash us/block':>14} "
          f"{'hashing ms/prefill step':>24} {'hashing ms/decode step':>23}")
    summary = []
    for block_size in args.block_sizes:
        for algo in args.algos:
            mine = [r for r in runs if r["block_size"] == block_size and r["algo"] == algo]
            row = {"block_size": block_size, "algo": algo, "runs": mine,
                   "hash_us_per_block": hash_costs[f"{algo}/{block_size}"],
                   "hashes_per_prefill_step": counts[block_size]["hashes_per_prefill_step"],
                   "hashes_per_decode_step": counts[block_size]["hashes_per_decode_step"]}
            row["hash_ms_per_prefill_step"] = row["hash_us_per_block"] * row["hashes_per_prefill_step"] / 1e3
            row["hash_ms_per_decode_step"] = row["hash_us_per_block"] * row["hashes_per_decode_step"] / 1e3
            for key in ("prefill_ms_per_step", "decode_ms_per_step", "total_s"):
                values = [r[key] for r in mine]
                row[key] = {"min": min(values), "max": max(values), "median": statistics.median(values)}
            summary.append(row)
            print(f"{block_size:>6} {algo:>7} {_span(row['prefill_ms_per_step']):>16} "
                  f"{_span(row['decode_ms_per_step'], 3):>16} {_span(row['total_s']):>14} "
                  f"{row['hash_us_per_block']:>14.2f} "
                  f"{row['hash_ms_per_prefill_step']:>12.3f} ({row['hashes_per_prefill_step']:>6.0f} blocks) "
                  f"{row['hash_ms_per_decode_step']:>11.3f} ({row['hashes_per_decode_step']:>5.1f} blocks)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                    "results": summary}, indent=2))


if __name__ == "__main__":
    main()
