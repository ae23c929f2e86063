"""What structured outputs cost: N concurrent json_schema requests against N unconstrained ones, offline.

Both runs generate the same number of tokens (``max_tokens`` each: unconstrained requests ignore EOS; the schema's
array needs more items than fit, so the grammar never completes early), so the ratio of their output tokens/s is
the cost of the grammar: the matchers' bitmasks on the host, the mask on the device, and (with asynchronous
scheduling) the steps that cannot be planned ahead. Rounds alternate A/B/A/B (the machine may be shared); the
table gives each round and the median ratio; JSON goes to --out. The grammar's cold compile time is reported
separately (compiled once before timing, as a server would on the first request with the schema).

    # CPU, the embedded SmolLM2-135M-Instruct
    python benchmarks/structured_outputs.py --num-requests 64 --max-tokens 48
    # GPU, Qwen3-0.6B shape (random weights) with a tokenizer folder (it has none; e.g. SmolLM2's, saved with
    # --save-tokenizer DIR on a machine with the embedded model)
    python benchmarks/structured_outputs.py --model benchmarks/model_configs/qwen3-0.6b --load-format dummy \\
        --tokenizer DIR --num-requests 64 --max-tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "kind": {"type": "string", "enum": ["report", "memo", "note"]},
        "entries": {"type": "array", "minItems": 1000, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "score": {"type": "integer"},
                           "ok": {"type": "boolean"}},
            "required": ["name", "score", "ok"], "additionalProperties": False}},
    },
    "required": ["title", "kind", "entries"],
    "additionalProperties": False,
}
QUESTIONS = ["List the results of the last survey.", "Write a status report as JSON.", "Summarise the scores.",
             "Give me the entries of the table."]


def prompts(llm: LLM, count: int) -> list:
    tokenizer = llm.tokenizer
    out = []
    for i in range(count):
        question = f"{QUESTIONS[i % len(QUESTIONS)]} (request {i})"
        if getattr(tokenizer, "chat_template", None):
            out.append({"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": question}])})
        else:
            out.append(question)
    return out


def run(llm: LLM, batch: list, params: list[SamplingParams]) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder or GGUF (default: the embedded SmolLM2)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder, for a model folder without one")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--rounds", type=int, default=3, help="A/B pairs, alternated")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--save-tokenizer", metavar="DIR", default=None,
                        help="only save the model's tokenizer to DIR (for a model folder that has none) and exit")
    parser.add_argument("--out", default="results/structured_outputs.json")
    args = parser.parse_args()

    llm = LLM(args.model, tokenizer=args.tokenizer, load_format=args.load_format, device=args.device,
              max_model_len=args.max_model_len, max_num_seqs=max(args.num_requests, 1))
    if args.save_tokenizer:
        llm.tokenizer.save_pretrained(args.save_tokenizer)
        print(f"saved the tokenizer to {args.save_tokenizer}")
        return
    batch = prompts(llm, args.num_requests)
    constraint = StructuredOutputsParams(json=SCHEMA)
    start = time.perf_counter()
    llm.check_structured_outputs(constraint)  # the cold compile (then cached)
    compile_ms = (time.perf_counter() - start) * 1e3

    plain = [SamplingParams(temperature=args.temperature, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
             for i in range(args.num_requests)]
    constrained = [SamplingParams(temperature=args.temperature, seed=i, max_tokens=args.max_tokens,
                                  structured_outputs=constraint) for i in range(args.num_requests)]
    run(llm, batch[:4], plain[:4])  # warm-up: shapes and compiled ops
    run(llm, batch[:4], constrained[:4])
    variants = {"unconstrained": plain, "json_schema": constrained}
    if llm.async_scheduling:  # what the grammar costs beyond the steps it cannot plan ahead
        variants["unconstrained, no async scheduling"] = plain
    rounds = []
    for _ in range(args.rounds):
        row = {}
        for name, params in variants.items():
            llm.async_scheduling = name != "unconstrained, no async scheduling" and llm.config.async_scheduling_enabled
            seconds, tokens = run(llm, batch, params)
            row[name] = {"seconds": round(seconds, 3), "output_tokens": tokens, "tok_s": round(tokens / seconds, 1)}
        row["ratio"] = round(row["json_schema"]["tok_s"] / row["unconstrained"]["tok_s"], 3)
        rounds.append(row)
    llm.async_scheduling = llm.config.async_scheduling_enabled

    print(f"{args.num_requests} requests x {args.max_tokens} tokens on {llm.config.device}; json_schema compile "
          f"{compile_ms:.1f} ms (cold)")
    names = list(variants)
    print(f"{'round':<7}" + "".join(f"{n + ' tok/s':>38}" for n in names) + f"{'json/unconstrained':>20}")
    for i, row in enumerate(rounds):
        print(f"{i:<7}" + "".join(f"{row[n]['tok_s']:>38,.1f}" for n in names) + f"{row['ratio']:>20.3f}")
    ratios = [r["ratio"] for r in rounds]
    print(f"median ratio {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"num_requests": args.num_requests, "max_tokens": args.max_tokens, "device": str(llm.config.device),
                   "model": args.model or "SmolLM2-135M-Instruct (embedded)", "tokenizer": args.tokenizer,
                   "compile_ms": round(compile_ms, 1), "rounds": rounds,
                   "median_ratio": statistics.median(ratios)}, f, indent=2)
    llm.close()


if __name__ == "__main__":
    main()
