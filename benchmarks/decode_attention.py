"""Microbenchmark of the split-K decode attention kernel: achieved memory bandwidth against the copy bandwidth.

    python benchmarks/decode_attention.py --out results/decode_attention.json          # GPU
    python benchmarks/decode_attention.py --sweep --out results/decode_sweep.json     # + splits/configs
    python benchmarks/decode_attention.py --smoke --out /tmp/smoke.json                # CPU interpreter

Bytes moved per call = K and V of every request's seq_len keys + q read + out written; bandwidth =
bytes / time (median of triton.testing.do_bench, which flushes L2 before each run). The KV pool is
scattered: each request's blocks are a random permutation of the pool, as after a while of serving.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.card import H200_COPY_BANDWIDTH, copy_bandwidth_tbps  # noqa: E402

TARGET_FRACTION = 0.75  # of the copy bandwidth measured in the same run
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# (block_n, num_warps, num_stages[, max_registers]) tried by --sweep besides the default
SWEEP_CONFIGS = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (128, 4, 4), (128, 4, 5), (128, 4, 6),
                 (128, 8, 4), (32, 4, 3), (64, 8, 3), (64, 4, 6), (64, 4, 8), (128, 4, 6, 168), (64, 4, 6, 112),
                 (64, 4, 4, 96), (64, 4, 6, 96), (128, 8, 6)]
SWEEP_SPLITS = [1, 2, 4, 8, 16, 32, 64, 128]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024, help="seq_len of every request (keys read)")
    parser.add_argument("--min-context", type=int, default=None,
                        help="ragged batch: seq_lens uniform in [min-context, context] (as in W1's decode)")
    parser.add_argument("--plan-len", type=int, default=None,
                        help="the max_seq_len the split plan is made for (default: context; the engine's "
                             "CUDA graphs plan for max_model_len)")
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[256, 16])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="fp8: the cache is e4m3 (scales 0.05 / 0.02), read by the kernel into --dtype")
    parser.add_argument("--sweep", action="store_true", help="also try other split counts and tile configs")
    parser.add_argument("--smoke", action="store_true",
                        help="no GPU: tiny shapes under the Triton CPU interpreter, to check the script runs")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    import torch

    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        args.batch, args.context, args.num_heads, args.num_kv_heads, args.head_dim = 4, 100, 4, 2, 64
        args.dtype, args.block_sizes, device = "fp16", [16, 128], "cpu"
    elif not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU (or --smoke to check the script on the CPU interpreter)",
              file=sys.stderr)
        return 2
    else:
        device = "cuda"

    import triton.testing

    from nanovllm.attention.reference import decode_attention_ref
    from nanovllm.kernels.decode_attention import (
        DecodeConfig,
        decode_attention,
        default_decode_config,
        plan_splits,
    )

    dtype = getattr(torch, DTYPES[args.dtype])
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else dtype
    k_scale, v_scale = (0.05, 0.02) if args.kv_cache_dtype == "fp8" else (1.0, 1.0)
    elem = dtype.itemsize
    batch, context, heads, kv_heads, head_dim = args.batch, args.context, args.num_heads, args.num_kv_heads, \
        args.head_dim
    scale = head_dim**-0.5
    plan_len = max(args.plan_len or context, context)

    def time_ms(fn) -> float:
        if device == "cuda":
            return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    copy_tbps = copy_bandwidth_tbps(time_ms, device) if device == "cuda" else H200_COPY_BANDWIDTH / 1e12  # --smoke reports the H200's
    default_config = default_decode_config(head_dim, kv_dtype, torch.device(device))
    results = []
    for block_size in args.block_sizes:
        blocks_per_seq = triton.cdiv(context, block_size)
        num_blocks = batch * blocks_per_seq
        gen = torch.Generator(device=device).manual_seed(0)
        k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device, generator=gen).to(kv_dtype)
        v_cache = torch.randn(k_cache.shape, device=device, generator=gen).to(kv_dtype)
        block_tables = torch.randperm(num_blocks, device=device, generator=gen).view(batch, blocks_per_seq).int()
        if args.min_context is None:
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        else:
            seq_lens = torch.randint(args.min_context, context + 1, (batch,), device=device, generator=gen,
                                     dtype=torch.int32)
        keys = int(seq_lens.sum())
        bytes_moved = 2 * keys * kv_heads * head_dim * kv_dtype.itemsize + 2 * batch * heads * head_dim * elem
        q = torch.randn(batch, heads, head_dim, device=device, generator=gen).to(dtype)
        out = torch.empty_like(q)

        ref = decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale)
        plans: list[tuple[str, int | None, DecodeConfig]] = [("default", None, default_config)]
        if args.sweep:
            plans += [("splits", s, default_config) for s in SWEEP_SPLITS]
            plans += [("config", None, DecodeConfig(*c)) for c in SWEEP_CONFIGS]
        for label, num_splits, config in plans:
            splits, _ = plan_splits(batch, kv_heads, plan_len, config.block_n, q.device, num_splits)

            run = functools.partial(decode_attention, q, k_cache, v_cache, block_tables, seq_lens, scale, plan_len,
                                    out=out, num_splits=num_splits, config=config, k_scale=k_scale,
                                    v_scale=v_scale)
            try:
                max_err = (run().float() - ref.float()).abs().max().item()
                ms = time_ms(run)
            except Exception as exc:  # e.g. a sweep config out of shared memory: report it, keep going
                print(f"block_size {block_size} {label} {config}: failed: {exc}", file=sys.stderr)
                continue
            tbps = bytes_moved / (ms * 1e-3) / 1e12
            results.append(dict(block_size=block_size, plan=label, bytes=bytes_moved, num_splits=splits, block_n=config.block_n,
                                num_warps=config.num_warps, num_stages=config.num_stages,
                                max_registers=config.max_registers, time_us=ms * 1e3,
                                tbps=tbps, fraction_of_copy=tbps / copy_tbps, max_abs_err=max_err))

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (triton interpreter)"
    lengths = f"context {context}" if args.min_context is None else f"contexts {args.min_context}-{context}"
    print(f"decode attention on {name}: batch {batch}, {lengths} (split plan for {plan_len}), heads "
          f"{heads}/{kv_heads}, head_dim {head_dim}, {args.dtype}, KV cache {args.kv_cache_dtype}, {bytes_moved / 1e6:.1f} MB per call "
          f"(last block size); copy bandwidth {copy_tbps:.2f} TB/s (read + write, "
          f"{'measured here' if device == 'cuda' else 'an H200, recorded'})")
    print(f"{'block':>5} {'plan':>8} {'splits':>6} {'BLOCK_N':>7} {'warps':>5} {'stages':>6} "
          f"{'regs':>5} {'time us':>9} {'TB/s':>6} {'of copy':>7} {'max err':>8}")
    for r in results:
        print(f"{r['block_size']:>5} {r['plan']:>8} {r['num_splits']:>6} {r['block_n']:>7} {r['num_warps']:>5} "
              f"{r['num_stages']:>6} {r['max_registers'] or '-':>5} {r['time_us']:>9.1f} {r['tbps']:>6.2f} {r['fraction_of_copy']:>7.1%} "
              f"{r['max_abs_err']:>8.1e}")
    defaults = [r for r in results if r["plan"] == "default"]
    passed = bool(defaults) and all(r["fraction_of_copy"] >= TARGET_FRACTION for r in defaults)
    if device == "cuda":
        print(f"target {TARGET_FRACTION:.0%} of the copy bandwidth with the default plan: {'met' if passed else 'NOT met'}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        benchmark="decode_attention", device=name, dtype=args.dtype, batch=batch, context=context,
        min_context=args.min_context, plan_len=plan_len,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, bytes_per_call=bytes_moved,
        copy_tbps=copy_tbps, target_fraction=TARGET_FRACTION, target_met=passed if device == "cuda" else None,
        results=results,
    ), indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
