"""Teacher-forced agreement of a CPU configuration with float32 on SmolLM2 chat answers (the quality gate of a CPU
default): float32 answers --prompts chat questions greedily (--max-tokens each), then every configuration scores
those answers in one prefill each; we count the positions where its top-1 token is float32's and the mean
log-probability it gives float32's tokens.

    python benchmarks/cpu_quality.py --engine-args '{}' --engine-args '{"cpu_int8": true}' --eight-bit
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
    """The token ids of `count` chat questions (cpu_peers.questions) under the model's chat template."""
    return [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions(count)]


def greedy_answers(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """llm's greedy answers (EOS ignored, so every answer has max_tokens positions), in one batch."""
    from nanovllm import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [o.token_ids for o in outs]


def score(llm, prompts, answers, top: int = 0):
    """Teacher forcing: one prefill of prompt + answer each; at every answer position llm's {token: Logprob} of the
    answer token (and of its top `top` tokens)."""
    from nanovllm import SamplingParams
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=top)
    outs = llm.generate([{"prompt_token_ids": p + a} for p, a in zip(prompts, answers)], scoring, use_tqdm=False)
    return [o.prompt_logprobs[len(p) + i] for p, a, o in zip(prompts, answers, outs) for i in range(len(a))]


def answer_token_logprobs(llm, prompts, answers):
    """llm's Logprob (logprob and rank) of every answer token, teacher-forced."""
    return [scored[t] for scored, t in zip(score(llm, prompts, answers), (t for a in answers for t in a))]


def top1_tokens(llm, prompts, answers) -> list[int]:
    """llm's most likely next token at every answer position, teacher-forced."""
    return [next(t for t, v in scored.items() if v.rank == 1) for scored in score(llm, prompts, answers, top=1)]


def top1_agreement(scored) -> float:
    """The share of positions where the scored token (float32's greedy one) is the model's top-1 too."""
    return sum(v.rank == 1 for v in scored) / len(scored)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--engine-args", action="append", default=None, help="JSON engine arguments; repeatable")
    parser.add_argument("--eight-bit", action="store_true",
                        help="also the default with every weight in 8-bit blocks (what a safetensors model gets)")
    args = parser.parse_args()
    os.environ.pop("NANOVLLM_CPU_DTYPE", None)
    from nanovllm import LLM
    from nanovllm.platforms.cpu import cpu_ops

    common = dict(model=args.model, max_model_len=1024, kvcache_block_size=16, num_kvcache_blocks=512)
    reference = LLM(dtype="float32", **common)
    prompts = chat_prompts(reference, args.prompts)
    answers = greedy_answers(reference, prompts, args.max_tokens)
    results = {"float32": answer_token_logprobs(reference, prompts, answers)}
    del reference
    configs = [(json.dumps(json.loads(a)), json.loads(a)) for a in (args.engine_args or ["{}"])]
    if args.eight_bit:
        configs.append(("{} (8-bit blocks)", {}))
    for name, engine_args in configs:
        original = cpu_ops.block_weight
        if name.endswith("(8-bit blocks)"):
            cpu_ops.block_weight = lambda w, bits=None, quantize=original: quantize(w, 8)
        try:
            llm = LLM(**common, **engine_args)
            results[name] = answer_token_logprobs(llm, prompts, answers)
            results[name + " cpu_linear"] = llm.config.cpu_linear
        finally:
            cpu_ops.block_weight = original
        del llm
    print(f"{len(results['float32'])} positions of {len(prompts)} answers")
    for name, values in results.items():
        if name.endswith("cpu_linear"):
            continue
        top1 = top1_agreement(values)
        mean = sum(v.logprob for v in values) / len(values)
        print(f"{name:40s} {results.get(name + ' cpu_linear', 'float')!s:7s} top-1 {100 * top1:5.1f} %  "
              f"mean log-probability {mean:.3f}")


if __name__ == "__main__":
    main()
