"""Teacher-forced top-1 agreement of a KV cache dtype with the model-dtype cache (the fp8 cache's accuracy gate):
the reference engine (the model's dtype, its own cache) answers --prompts chat questions greedily (--max-tokens
each); then the reference and every other cache score those same answers in one prefill each (the same weights and
dtype, only the cache differs), and we count the positions where the two top-1 tokens are the same.

    python benchmarks/kv_cache_quality.py --dtype bfloat16 --kv-cache-dtype fp8            # the CPU torch path
    python benchmarks/kv_cache_quality.py --device cuda --dtype bfloat16 --kv-cache-dtype fp8

Also printed: how often the reference's own scoring picks its greedy answer's token (batching and prefill-vs-decode
rounding alone), the floor any cache is measured against.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.cpu_peers import questions  # noqa: E402


def chat_prompts(llm, count: int) -> list[list[int]]:
    return [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions(count)]


def greedy_answers(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from nanovllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def top1_tokens(llm, prompts: list[list[int]], answers: list[list[int]]) -> list[int]:
    """The engine's top-1 token at every answer position, teacher-forced (one prefill per prompt + answer)."""
    from nanovllm import SamplingParams
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p + a} for p, a in zip(prompts, answers)], scoring, use_tqdm=False)
    top1 = []
    for prompt, answer, out in zip(prompts, answers, outs):
        for i in range(len(answer)):
            entry = out.prompt_logprobs[len(prompt) + i]
            top1.append(min(entry, key=lambda token: entry[token].rank))
    return top1


def agreement(a: list[int], b: list[int]) -> float:
    assert len(a) == len(b)
    return sum(x == y for x, y in zip(a, b)) / len(a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-dtype", action="append", default=None, help="repeatable; default fp8")
    parser.add_argument("--engine-args", default="{}", help="JSON engine arguments for every engine")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    from nanovllm import LLM

    common = dict(model=args.model, device=args.device, dtype=args.dtype, max_model_len=1024,
                  kvcache_block_size=16 if args.device == "cpu" else 256, enable_prefix_caching=False,
                  **json.loads(args.engine_args))
    reference = LLM(**common)
    prompts = chat_prompts(reference, args.prompts)
    answers = greedy_answers(reference, prompts, args.max_tokens)
    expected = top1_tokens(reference, prompts, answers)
    print(f"{len(expected)} positions of {len(prompts)} answers; {args.dtype} on {args.device}")
    print(f"reference scoring picks its greedy tokens at {100 * agreement(expected, sum(answers, [])):.1f} %")
    del reference
    for kv in args.kv_cache_dtype or ["fp8"]:
        llm = LLM(**common, kv_cache_dtype=kv)
        print(f"kv_cache_dtype {kv:10s} top-1 agreement {100 * agreement(top1_tokens(llm, prompts, answers), expected):.1f} %")
        del llm


if __name__ == "__main__":
    main()
