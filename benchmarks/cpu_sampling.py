"""What sampling costs on the CPU: each of its operations alone, then whole generations, greedy against sampled.

Part one times the sampler's operations over one step's logits (--rows x --vocab, float32): the softmax, the
inverse-CDF draw the CPU uses, the Exponential-noise draw it replaced, and top-p by the full sort against the CPU's
search among each row's most likely tokens, on peaked and on flat rows. Part two runs the embedded model (or
--model) on --num-requests chat prompts, greedy and with each sampling setting, top-k/top-p once by the CPU's
search and once by the full sort (the runner's hook swapped), rounds interleaved. Table on stdout, JSON to --out.

    python benchmarks/cpu_sampling.py --num-requests 64 --max-tokens 24 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from nanovllm.layers.sampler import apply_top_k_top_p, inverse_cdf_sample  # noqa: E402
from nanovllm.platforms.cpu import sampler as cpu_sampler  # noqa: E402

SETTINGS = {
    "temperature 0.7, top_p 0.95": dict(temperature=0.7, top_p=0.95),
    "temperature 1.0, top_p 0.9, top_k 50": dict(temperature=1.0, top_p=0.9, top_k=50),
}


def milliseconds(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def time_operations(rows: int, vocab: int, repeats: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(rows, vocab, generator=g) * 3  # a nucleus of thousands of tokens
    peaked = torch.randn(rows, vocab, generator=g) * 10  # a nucleus of a few
    probs = flat.softmax(dim=-1)
    top_p = torch.full((rows,), 0.95)
    return {
        "softmax": milliseconds(lambda: flat.softmax(dim=-1), repeats),
        "exponential noise + argmax": milliseconds(
            lambda: (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1), repeats),
        "inverse-CDF draw": milliseconds(lambda: inverse_cdf_sample(probs, None, {}), repeats),
        "top_p 0.95 full sort": milliseconds(lambda: apply_top_k_top_p(peaked, None, top_p), repeats),
        "top_p 0.95 candidates, peaked rows": milliseconds(
            lambda: cpu_sampler.top_k_top_p(peaked, None, top_p), repeats),
        "top_p 0.95 candidates, flat rows": milliseconds(
            lambda: cpu_sampler.top_k_top_p(flat, None, top_p), repeats),
    }


def time_generations(args) -> list[dict]:
    from nanovllm import LLM, SamplingParams

    llm = LLM(args.model) if args.model else LLM()
    runner = llm.llm_engine.runner
    prompts = [f"Tell me a short story about the number {i}." for i in range(args.num_requests)]
    modes = [("greedy", {}, None)]
    for name, setting in SETTINGS.items():
        modes += [(name, setting, "candidates"), (name, setting, "full sort")]
    hooks = {"candidates": runner.sampler.top_k_top_p, "full sort": apply_top_k_top_p}
    llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    results = []
    for round_ in range(args.rounds):
        for name, setting, hook in modes:
            runner.sampler.top_k_top_p = hooks[hook or "candidates"]
            params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, **({"temperature": 0} | setting))
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o["token_ids"]) for o in outputs)
            results.append(dict(round=round_, sampling=name, top_k_top_p=hook, tok_per_s=tokens / seconds))
            print(f"round {round_}  {name:40s} {hook or '':12s} {tokens / seconds:8.1f} tok/s", flush=True)
    runner.sampler.top_k_top_p = hooks["candidates"]
    llm.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-generations", action="store_true")
    parser.add_argument("--out", default="results/cpu_sampling.json")
    args = parser.parse_args(argv)

    operations = time_operations(args.rows, args.vocab, args.repeats)
    print(f"one step's sampling operations, {args.rows} x {args.vocab} float32, {torch.get_num_threads()} threads")
    for name, ms in operations.items():
        print(f"  {name:40s} {ms:8.1f} ms")
    generations = [] if args.skip_generations else time_generations(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(operations_ms=operations, generations=generations, rows=args.rows, vocab=args.vocab,
                       threads=torch.get_num_threads()), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
