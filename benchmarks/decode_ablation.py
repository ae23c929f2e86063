"""What each kernel of a small decode step costs on the step's critical path: the decode graph timed with one kind
of kernel left out (or its plan changed), against the graph as it is, in one process.

TIMING ONLY: a variant that leaves a kernel out computes wrong values. It answers "how much would the step gain
if this kernel's work were folded into a neighbour at no cost", the upper bound of a fusion, before building it.
At a few requests a step is a chain of ~9 dependent kernels a layer, each waiting for the one before, so the
bound is not the kernel's own duration in a profile (which overlaps its neighbours').

Variants (each builds the engine again with the change in place; the rounds interleave them), made of parts
joined by "+":
- main: the engine as it is;
- no_rope_store: no q/k norm + RoPE + K/V store kernel (attention reads q straight from the qkv projection);
- one_split: the decode attention in one split (no reduce kernel; each program reads all of its request's keys);
- no_attention: no decode attention at all (neither the split nor the reduce kernel);
- no_norms: no RMSNorm kernel (the decoder's norms return their input);
- plan_for_context: the graphs planned for the longest --contexts + --steps keys instead of --max-model-len (the
  split plan a graph per context bucket would give);
- min_split=N, max_splits=N, programs_per_sm=N, tile=N, stages=N, warps=N: the decode split plan's shortest split
  (keys), most splits or programs aimed for per SM, or the split kernel's key tile, pipeline stages or warps, set
  to N (these compute the right values).

    python benchmarks/decode_ablation.py --batch-sizes 1 8 --contexts 512 2048 --rounds 2
    python benchmarks/decode_ablation.py --variants main min_split=64 min_split=64+plan_for_context
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from decode_step import DEFAULT_MODEL, distinct_key_blocks, kernel_table, time_on_device  # noqa: E402

from nanovllm import LLM  # noqa: E402

PARTS = ("main", "no_rope_store", "one_split", "no_attention", "no_norms", "plan_for_context", "min_split=N",
         "max_splits=N", "programs_per_sm=N", "tile=N", "stages=N", "warps=N")


def _leave_out_rope_store(stack, rope_module):
    def q_view(qkv, positions, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, slot_mapping, num_heads,
               num_kv_heads, k_scale=1.0, v_scale=1.0, *, q_out=None):
        head_dim = k_cache.shape[-1]
        return qkv[:, :num_heads * head_dim].view(-1, num_heads, head_dim)
    stack.enter_context(mock.patch.object(rope_module, "norm_rope_store", q_view))


def _decode_with(stack, decode_module, **forced):
    original = decode_module.decode_attention

    def forcing(*args, **kwargs):
        return original(*args, **(kwargs | forced))
    stack.enter_context(mock.patch.object(decode_module, "decode_attention", forcing))


def _decode_config_with(stack, decode_module, **fields):
    original = decode_module.default_decode_config

    def changed(*args, **kwargs):
        return dataclasses.replace(original(*args, **kwargs), **fields)
    stack.enter_context(mock.patch.object(decode_module, "default_decode_config", changed))


def variant_in_place(variant: str) -> contextlib.ExitStack:
    """The monkeypatches of a variant ("a+b" combines parts), in place while an engine is built (the backend binds
    its kernels then, and the graphs capture what the patched functions launch)."""
    from nanovllm.kernels import decode_attention as decode_module
    from nanovllm.kernels import rms_norm as norm_module
    from nanovllm.kernels import rope_store as rope_module

    stack = contextlib.ExitStack()
    for part in variant.split("+"):
        name, _, value = part.partition("=")
        if name == "no_rope_store":
            _leave_out_rope_store(stack, rope_module)
        elif name == "one_split":
            _decode_with(stack, decode_module, num_splits=1)
        elif name == "no_attention":
            stack.enter_context(mock.patch.object(decode_module, "decode_attention",
                                        lambda q, *args, out=None, **kwargs: q if out is None else out))
        elif name == "no_norms":
            stack.enter_context(mock.patch.object(norm_module, "add_rms_norm", lambda x, weight, eps, residual=None:
                                        x if residual is None else (x, residual)))
        elif name == "min_split":  # the shortest split the plan makes, in keys
            stack.enter_context(mock.patch.object(decode_module, "MIN_TOKENS_PER_SPLIT", int(value)))
        elif name == "max_splits":
            stack.enter_context(mock.patch.object(decode_module, "MAX_SPLITS", int(value)))
        elif name == "programs_per_sm":  # the split plan's aim (more splits at a given batch)
            stack.enter_context(mock.patch.object(decode_module, "PROGRAMS_PER_SM", int(value)))
        elif name in ("tile", "stages", "warps"):
            field = {"tile": "block_n", "stages": "num_stages", "warps": "num_warps"}[name]
            _decode_config_with(stack, decode_module, **{field: int(value)})
        elif name not in ("main", "plan_for_context"):
            raise SystemExit(f"unknown variant part {part!r}; parts: {', '.join(PARTS)}")
    return stack


def graph_ms(variant: str, args) -> dict:
    plan_for_context = "plan_for_context" in variant.split("+")
    max_model_len = max(args.contexts) + args.steps if plan_for_context else args.max_model_len
    with variant_in_place(variant):
        llm = LLM(args.model, load_format="dummy", max_model_len=max_model_len, max_num_seqs=max(args.batch_sizes),
                  enable_prefix_caching=False)
    try:
        runner = getattr(llm.runner, "runner", llm.runner)
        graphs = runner.graphs
        row = {"variant": variant}
        for batch in args.batch_sizes:
            size = next(s for s in graphs.sizes if s >= batch)
            distinct_key_blocks(runner, size, max(args.contexts))
            graphs.slot_mapping[:size].fill_(-1)  # write no K/V
            graph = graphs.graphs[size]
            for context in args.contexts:
                graphs.seq_lens[:batch].fill_(context)
                graphs.seq_lens[batch:size].zero_()
                row[f"b{batch}_c{context}_ms"] = round(time_on_device(graph.replay, args.repeats), 4)
            row[f"b{batch}_kernels"] = kernel_table(graph.replay, 1)[0]
        return row
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512], help="keys of every request")
    parser.add_argument("--steps", type=int, default=64, help="keys past the longest context plan_for_context allows")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--variants", nargs="+", default=list(PARTS[:6]), help=f"parts joined by '+': {PARTS}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default="results/decode_ablation.json")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "the decode graph needs a GPU"
    rows = []
    for round_index in range(args.rounds):
        for variant in args.variants:
            row = graph_ms(variant, args) | {"round": round_index}
            rows.append(row)
            print(json.dumps(row), flush=True)
    columns = [(b, c) for b in args.batch_sizes for c in args.contexts]
    print(f"\n{'variant':<28}" + "".join(f"{f'b{b} c{c} ms':>22}{'saved':>8}" for b, c in columns)
          + "".join(f"{f'b{b} kernels':>12}" for b in args.batch_sizes))
    for variant in args.variants:
        mine = [r for r in rows if r["variant"] == variant]
        line = f"{variant:<28}"
        for b, c in columns:
            key = f"b{b}_c{c}_ms"
            ms = [r[key] for r in mine]
            base = [r[key] for r in rows if r["variant"] == "main"]
            saved = min(base) - min(ms) if base else float("nan")
            line += f"{' / '.join(f'{m:.3f}' for m in ms):>22}{saved:>8.3f}"
        print(line + "".join(f"{mine[0][f'b{b}_kernels']:>12}" for b in args.batch_sizes))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
