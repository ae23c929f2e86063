"""Long prompts: prefill TFLOP/s and decode milliseconds a step against their floors.

For each prompt length and batch size: one call with max_tokens=1 times the prefill (every prompt at once,
chunked by the step budget), a second with max_tokens=1+S adds S decode steps; a decode step is the mean wall time
of that call's decode-only steps (those with no prompt tokens; the first requests' first decodes ride in the later
prompts' chunks), so the two calls' prefill spread does not land in it. Random weights from a config.json (Qwen3-0.6B shape by default), random token ids, prefix caching off.
Prompts past the model's window get YaRN (factor 4 over the config's max_position_embeddings or
original_max_position_embeddings), as Qwen3's model cards describe for 128k contexts.

    python benchmarks/long_context.py --prompt-lens 8192 32768 131000 --batches 1 8 --out results/long_context.json

Floors: prefill = (matmul + causal attention FLOPs) / the bf16 peak; decode = (weights + every request's K/V)
bytes / the copy bandwidth: the H200's recorded 4.25 TB/s (the issues' figure) and, on CUDA, the copy bandwidth
measured on this card in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.card import H200_COPY_BANDWIDTH, measured_copy_bandwidth  # noqa: E402
from benchmarks.throughput import StepTimer  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL = os.path.join(HERE, "model_configs", "qwen3-0.6b")
# the H200's bf16 dense peak (the issue's figure)
PEAK_FLOPS = 787e12


def yarn_model(model: str, context: int) -> str:
    """model itself when its window holds context tokens; else a copy of its config.json with YaRN rope scaling
    stretching the trained window by 4 (and max_position_embeddings raised to match)."""
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    trained = int(config.get("max_position_embeddings", 4096))
    if context <= trained:
        return model
    trained = min(trained, 32768)  # Qwen3's cards: 32,768 trained positions x 4
    if context > 4 * trained:
        raise SystemExit(f"a {context}-token context is past YaRN x4 of this model's {trained} positions")
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": trained}
    config["max_position_embeddings"] = 4 * trained
    folder = tempfile.mkdtemp(prefix="yarn-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def model_shape(llm: LLM) -> dict:
    """What the floors need: parameters a token multiplies by, K/V bytes a token, and attention's dimensions."""
    cfg = llm.hf_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    model = getattr(llm.runner, "runner", llm.runner).model
    params = sum(p.numel() for p in model.parameters())
    embedding = model.model.embed_tokens.weight.numel()
    itemsize = next(model.parameters()).element_size()
    return dict(
        # a prompt token multiplies by every weight but the embeddings (the LM head runs for the last token only)
        matmul_params=params - embedding * (1 if model.tie_word_embeddings else 2),
        lm_head_params=embedding,
        read_bytes=(params - (0 if model.tie_word_embeddings else embedding)) * itemsize,
        kv_bytes=2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * itemsize,
        attention_dims=cfg.num_hidden_layers * cfg.num_attention_heads * head_dim,
    )


def prefill_flops(shape: dict, prompt_len: int, batch: int) -> float:
    causal_pairs = prompt_len * (prompt_len + 1) / 2  # query-key pairs a causal prompt computes
    per_request = (2 * shape["matmul_params"] * prompt_len + 2 * shape["lm_head_params"]
                   + 4 * shape["attention_dims"] * causal_pairs)  # q.k and p.v: two multiply-adds a pair a dim
    return batch * per_request


def timed_generate(llm: LLM, prompts, max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(o.token_ids) == max_tokens for o in outputs)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a folder with config.json (random weights)")
    # 128k: a prompt that with its decode steps stays within YaRN's 131,072 positions
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[8192, 32768, 131000])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384,
                        help="the step budget: longer prompts are prefilled in chunks of this many tokens")
    parser.add_argument("--max-context", type=int, default=None,
                        help="skip (prompt, batch) pairs whose K/V exceeds this many tokens in all (default: "
                             "what the pool holds)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default="results/long_context.json")
    args = parser.parse_args()

    card_copy = measured_copy_bandwidth()  # before the engine takes the card's memory
    longest = max(args.prompt_lens) + args.decode_steps + 1
    model = yarn_model(args.model, longest)
    try:
        llm = LLM(model, load_format="dummy", max_model_len=longest, enable_prefix_caching=False,
                  max_num_seqs=max(args.batches), max_num_batched_tokens=args.max_num_batched_tokens,
                  enforce_eager=args.enforce_eager, device=args.device)
    finally:
        if model != args.model:
            shutil.rmtree(model, ignore_errors=True)
    shape = model_shape(llm)
    capacity = args.max_context or llm.num_kvcache_blocks * llm.config.kvcache_block_size
    rng = random.Random(0)
    vocab = min(10000, llm.vocab_size)
    timed_generate(llm, [[rng.randrange(vocab) for _ in range(min(2048, longest - 9))]], 8)  # warm-up: kernels, graphs

    rows = []
    for prompt_len in args.prompt_lens:
        for batch in args.batches:
            if batch * (prompt_len + args.decode_steps + 1) > capacity:
                print(f"skipped {batch} x {prompt_len}: more K/V than the pool's {capacity} tokens")
                continue
            prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
            prefill = timed_generate(llm, prompts, 1)
            steps = StepTimer(llm)
            timed_generate(llm, prompts, 1 + args.decode_steps)
            steps.close()
            decode_steps, decode_seconds = steps.totals["decode"]
            step = decode_seconds / max(decode_steps, 1)
            flops = prefill_flops(shape, prompt_len, batch)
            mean_context = prompt_len + 1 + args.decode_steps / 2
            decode_bytes = shape["read_bytes"] + batch * mean_context * shape["kv_bytes"]
            decode_floor = decode_bytes / H200_COPY_BANDWIDTH
            card_floor = decode_bytes / card_copy if card_copy else None
            rows.append(dict(prompt_len=prompt_len, batch=batch, prefill_seconds=round(prefill, 4),
                             prefill_tflops=round(flops / prefill / 1e12, 1),
                             fraction_of_peak=round(flops / prefill / PEAK_FLOPS, 3),
                             decode_ms=round(1e3 * step, 3), decode_floor_ms=round(1e3 * decode_floor, 3),
                             decode_over_floor=round(step / decode_floor, 2) if decode_floor else None,
                             decode_steps_timed=decode_steps,
                             card_copy_tbps=round(card_copy / 1e12, 2) if card_copy else None,
                             card_floor_ms=round(1e3 * card_floor, 3) if card_floor else None,
                             decode_over_card_floor=round(step / card_floor, 2) if card_floor else None,
                             max_num_batched_tokens=args.max_num_batched_tokens, decode_steps=args.decode_steps,
                             enforce_eager=args.enforce_eager))

    print(f"{'prompt':>8}{'batch':>6}{'prefill s':>11}{'TFLOP/s':>9}{'of peak':>9}{'decode ms':>11}"
          f"{'floor ms':>10}{'x floor':>9}{'card floor':>12}{'x card':>8}")
    for r in rows:
        print(f"{r['prompt_len']:>8}{r['batch']:>6}{r['prefill_seconds']:>11.3f}{r['prefill_tflops']:>9.1f}"
              f"{r['fraction_of_peak']:>9.2f}{r['decode_ms']:>11.3f}{r['decode_floor_ms']:>10.3f}"
              f"{r['decode_over_floor']:>9.2f}{r['card_floor_ms'] or float('nan'):>12.3f}"
              f"{r['decode_over_card_floor'] or float('nan'):>8.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    llm.close()


if __name__ == "__main__":
    main()
