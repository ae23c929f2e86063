"""The wall time of one step with a prefill in it, by prompt length: what a running request's next token waits for
whenever a new prompt joins (by default such steps replay piecewise CUDA graphs: engine/piecewise_graphs.py).

Each timed call is ``LLM.generate`` of one fresh random prompt with one output token (prefix caching off), so it
is one prefill step plus the call's own bookkeeping. Prints a table (median and min ms after warm-up calls) and
writes JSON.

    python benchmarks/prefill_step.py --prompt-lens 16 512 2048 [--cudagraph-mode full_decode_only]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm import LLM, SamplingParams  # noqa: E402

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_configs", "qwen3-0.6b")


def time_prefills(llm: LLM, prompt_len: int, runs: int, warmup: int, rng: random.Random) -> list[float]:
    """Seconds of each timed one-prompt call (fresh random token ids each time)."""
    high = min(10000, llm.hf_config.vocab_size)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    seconds = []
    for i in range(warmup + runs):
        prompt = [rng.randrange(min(100, high - 1), high) for _ in range(prompt_len)]
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a folder with config.json (random weights)")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[16, 512])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cudagraph-mode", default="full_and_piecewise",
                        help="full_and_piecewise (the default: such a step replays graphs in pieces), "
                             "full_decode_only (it runs eager), piecewise or none")
    parser.add_argument("--out", default="results/prefill_step.json")
    args = parser.parse_args()

    llm = LLM(args.model, load_format="dummy", enable_prefix_caching=False, cudagraph_mode=args.cudagraph_mode,
              max_model_len=max(4096, max(args.prompt_lens) + 1))
    rng = random.Random(0)
    device = str(llm.llm_engine.config.device)
    rows = []
    try:
        for prompt_len in args.prompt_lens:
            seconds = time_prefills(llm, prompt_len, args.runs, args.warmup, rng)
            rows.append({"prompt_len": prompt_len, "median_ms": round(statistics.median(seconds) * 1e3, 3),
                         "min_ms": round(min(seconds) * 1e3, 3), "runs_ms": [round(s * 1e3, 3) for s in seconds]})
    finally:
        llm.close()
    print(f"{'prompt tokens':>13}  {'median ms':>9}  {'min ms':>7}")
    for row in rows:
        print(f"{row['prompt_len']:>13}  {row['median_ms']:>9.2f}  {row['min_ms']:>7.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "device": device, "cudagraph_mode": args.cudagraph_mode,
                   "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
