"""Speculative decoding (n-gram) against plain decoding, one request at a time.

Two modes:

* ``--mode requests`` (default; the CPU and the embedded model unless --model/--device say otherwise): greedy
  chat requests that ask to copy or edit a given passage ("copy") and free-form questions ("free"), each run
  plain and with speculation, interleaved request by request (the machine's noise hits both alike). Prints
  output tok/s of each, their ratio, the mean acceptance length, and checks the tokens are the same.
* ``--mode step`` (GPU): the time of one decode step at batch 1 against one verify step of k draft tokens at
  batch 1 (k + 1 decode rows), on random weights of a config.json (default: Qwen3-0.6B's shape).

    python benchmarks/speculative.py --out results/speculative.json
    python benchmarks/speculative.py --mode step --device cuda --out results/verify_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm import LLM, SamplingParams  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
QWEN3_SHAPE = os.path.join(HERE, "model_configs", "qwen3-0.6b")

PASSAGES = [
    "The old lighthouse stood at the edge of the cliff for more than a century. Every night its keeper climbed "
    "the spiral stairs, trimmed the wick and polished the great lens, so that ships passing in the dark would "
    "know where the rocks were. When the keeper grew old, his daughter took over the work, and she kept the "
    "light burning through storms that tore the shutters from the windows.",
    "To make a simple bread, mix five hundred grams of flour with ten grams of salt and seven grams of dried "
    "yeast. Add three hundred and fifty millilitres of warm water and knead the dough for ten minutes until it "
    "is smooth. Leave it to rise for an hour, shape it into a loaf, let it rise again, and bake it at two "
    "hundred and twenty degrees for thirty minutes.",
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n    return total / "
    "len(values)\n\n\ndef variance(values):\n    m = mean(values)\n    total = 0\n    for value in values:\n"
    "        total += (value - m) ** 2\n    return total / len(values)\n",
    "Our meeting on Tuesday covered three topics. First, the budget for next year was approved with a small "
    "increase for travel. Second, the new office will open in March, and every team should send its list of "
    "equipment by the end of January. Third, the annual review process will move online.",
]
COPY_TASKS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Rewrite the following text, changing only the word 'the' to 'THE' and nothing else:\n\n{}",
]
FREE_PROMPTS = [
    "Write a short poem about the sea at night.",
    "What are three good habits for staying healthy? Explain each briefly.",
    "Tell me a short story about a robot who learns to paint.",
    "Why is the sky blue? Answer in a few sentences.",
    "Give me some ideas for a birthday party for a ten-year-old.",
    "Describe your ideal weekend in a paragraph.",
]


def conversations(kind: str) -> list[list[dict]]:
    if kind == "copy":
        texts = [task.format(p) for p in PASSAGES for task in COPY_TASKS]
    else:
        texts = FREE_PROMPTS
    return [[{"role": "user", "content": t}] for t in texts]


def timed_chat(llm: LLM, conversation, params) -> tuple[list[int], float]:
    start = time.perf_counter()
    out = llm.chat(conversation, params, use_tqdm=False)[0]
    return out.outputs[0].token_ids, time.perf_counter() - start


def run_requests(args) -> dict:
    engine = dict(model=args.model, device=args.device)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min}
    plain = LLM(**engine)
    speculative = LLM(**engine, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    warm = conversations("free")[0]
    timed_chat(plain, warm, SamplingParams(temperature=0, max_tokens=8))
    timed_chat(speculative, warm, SamplingParams(temperature=0, max_tokens=8))
    results = {}
    for kind in args.kinds:
        rows = []
        stats = speculative.scheduler.spec_stats
        before = (stats.num_drafts, stats.num_accepted_tokens)
        for rep in range(args.repeats):
            for i, conversation in enumerate(conversations(kind)[:args.num_requests]):
                # alternate which engine goes first: a slow stretch of the shared machine hits both alike
                order = [("plain", plain), ("spec", speculative)]
                if (i + rep) % 2:
                    order.reverse()
                row = {"request": i, "repeat": rep}
                for name, llm in order:
                    row[name + "_tokens"], row[name + "_seconds"] = timed_chat(llm, conversation, params)
                row["same_tokens"] = row["plain_tokens"] == row["spec_tokens"]
                row["num_tokens"] = len(row.pop("plain_tokens"))
                row.pop("spec_tokens")
                rows.append(row)
                print(f"  {kind} request {i}: {row['num_tokens']} tokens, plain {row['plain_seconds']:.2f} s, "
                      f"spec {row['spec_seconds']:.2f} s ({row['plain_seconds'] / row['spec_seconds']:.2f}x), "
                      f"same tokens {row['same_tokens']}", flush=True)
        drafts = stats.num_drafts - before[0]
        accepted = stats.num_accepted_tokens - before[1]
        tokens = sum(r["num_tokens"] for r in rows)
        plain_s = sum(r["plain_seconds"] for r in rows)
        spec_s = sum(r["spec_seconds"] for r in rows)
        ratios = [r["plain_seconds"] / r["spec_seconds"] for r in rows]
        results[kind] = {
            "requests": len(rows), "output_tokens": tokens,
            "plain_tok_s": tokens / plain_s, "spec_tok_s": tokens / spec_s, "speedup": plain_s / spec_s,
            "speedup_per_request_min": min(ratios), "speedup_per_request_median": statistics.median(ratios),
            "speedup_per_request_max": max(ratios),
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0, "drafts": drafts,
            "all_tokens_equal": all(r["same_tokens"] for r in rows), "rows": rows,
        }
    print(f"{'prompts':8} {'reqs':>5} {'tokens':>7} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} "
          f"{'per-request (min/med/max)':>26} {'accept len':>11} {'same tokens':>12}")
    for kind, r in results.items():
        spread = (f"{r['speedup_per_request_min']:.2f}/{r['speedup_per_request_median']:.2f}/"
                  f"{r['speedup_per_request_max']:.2f}")
        print(f"{kind:8} {r['requests']:5d} {r['output_tokens']:7d} {r['plain_tok_s']:12.1f} {r['spec_tok_s']:11.1f} "
              f"{r['speedup']:7.2f}x {spread:>26} {r['mean_acceptance_length']:11.2f} {str(r['all_tokens_equal']):>12}")
    return {"mode": "requests", "k": args.k, "prompt_lookup": [args.lookup_min, args.lookup_max],
            "max_tokens": args.max_tokens, "device": plain.config.device, "results": results}


def run_step(args) -> dict:
    """One decode step (1 row) against one verify step of k drafts (k + 1 rows), a request of --context tokens."""
    import torch

    from nanovllm.engine.sequence import Sequence

    llm = LLM(args.model or QWEN3_SHAPE, load_format="dummy", device=args.device, max_model_len=args.context + 64,
              enforce_eager=args.enforce_eager, async_scheduling=False)
    runner, bm = llm.runner, llm.scheduler.block_manager
    seq = Sequence(list(range(100, 100 + args.context)))
    bm.allocate(seq)
    seq.num_scheduled_tokens = seq.num_tokens
    runner.run([seq])  # the prompt's K/V
    seq.num_cached_tokens, seq.is_prefill = seq.num_tokens - 1, False
    bm.reserve_slots(seq, seq.num_tokens + args.k)

    def timing(drafts: list[int]) -> list[float]:
        seq.draft_token_ids = drafts
        seq.num_scheduled_tokens = 1 + len(drafts)
        times = []
        for i in range(args.warmup + args.iters):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            runner.run([seq])  # waits for the sampled tokens on the host, as the engine does
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        return times

    drafts = list(range(7, 7 + args.k))
    plain, verify = [], []
    for _ in range(args.rounds):  # interleaved rounds
        plain += timing([])
        verify += timing(drafts)
    result = {"mode": "step", "model": args.model or QWEN3_SHAPE, "device": args.device, "k": args.k,
              "context": args.context, "cuda_graphs": runner.graphs is not None,
              "plain_ms_median": 1e3 * statistics.median(plain), "verify_ms_median": 1e3 * statistics.median(verify)}
    result["ratio"] = result["verify_ms_median"] / result["plain_ms_median"]
    print(f"{'step':8} {'rows':>5} {'median ms':>10}")
    print(f"{'decode':8} {1:5d} {result['plain_ms_median']:10.3f}")
    print(f"{'verify':8} {args.k + 1:5d} {result['verify_ms_median']:10.3f}   ({result['ratio']:.2f}x; graphs: "
          f"{result['cuda_graphs']})")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("requests", "step"), default="requests")
    parser.add_argument("--model", default=None, help="default: the embedded model (requests), Qwen3-0.6B (step)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--kinds", nargs="+", default=["copy", "free"], choices=("copy", "free"))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--num-requests", type=int, default=None, help="requests of each kind (default: all)")
    parser.add_argument("--context", type=int, default=512, help="step mode: tokens before the step")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = run_requests(args) if args.mode == "requests" else run_step(args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
