"""Microbenchmark of the prefill attention kernel: causal TFLOP/s against the bf16 peak, over tile configs.

    python benchmarks/prefill_attention.py --out results/prefill_attention.json     # GPU: 8k, 32k, chunks of 128k
    python benchmarks/prefill_attention.py --smoke --out /tmp/smoke.json            # CPU interpreter
    python benchmarks/prefill_attention.py --kv-cache-dtype fp8 --out results/prefill_fp8.json   # an e4m3 cache

Each case is one request: a chunk of query_len queries after context_len cached keys (a whole prompt when
the context is 0; the last chunk of a chunked 128k prompt otherwise). FLOPs = 4 x heads x head_dim x the
query-key pairs the causal chunk computes; time = median of triton.testing.do_bench. Every config of
CONFIGS runs on every case, so the table shows which tiling to make the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

PEAK_TFLOPS = 787.0  # H200, bf16 dense
# (block_m, block_n, num_warps, num_stages, heads a program, K/V tiles by descriptor (TMA) or gathered by key)
CONFIGS = [(128, 128, 8, 2, 1, False), (128, 128, 8, 2, 1, True), (64, 64, 4, 2, 1, True), (64, 64, 4, 3, 1, True),
           (64, 64, 4, 2, 2, True), (64, 64, 4, 3, 2, True), (64, 64, 4, 4, 2, True), (64, 64, 8, 3, 2, True),
           (64, 128, 4, 3, 2, True), (128, 64, 8, 3, 2, True), (64, 64, 4, 3, 4, True), (32, 64, 4, 3, 4, True)]
CASES = [(8192, 0), (32768, 0), (16384, 131072 - 16384)]  # (query_len, context_len)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="fp8: the cache is e4m3 (scales 0.05 / 0.02), read into the products' dtype")
    parser.add_argument("--default-only", action="store_true", help="time the default tiling alone")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes under the Triton CPU interpreter")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch
    import triton

    from nanovllm.kernels.prefill_attention import PrefillConfig, default_prefill_config, prefill_attention

    device, dtype = ("cpu", torch.float16) if args.smoke else ("cuda", torch.bfloat16)
    cases, configs = CASES, [] if args.default_only else CONFIGS
    if args.smoke:
        args.num_heads, args.num_kv_heads, args.head_dim, args.block_size = 4, 2, 32, 16
        cases, configs = [(40, 0), (20, 30)], [(16, 16, 4, 2, 1, False), (16, 16, 4, 2, 2, True)]
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else dtype
    k_scale, v_scale = (0.05, 0.02) if args.kv_cache_dtype == "fp8" else (1.0, 1.0)
    group = args.num_heads // args.num_kv_heads
    rows = []
    for query_len, context_len in cases:
        seq_len = query_len + context_len
        num_blocks = triton.cdiv(seq_len, args.block_size)
        gen = torch.Generator(device=device).manual_seed(0)
        k_cache = torch.randn(num_blocks, args.block_size, args.num_kv_heads, args.head_dim, device=device,
                              generator=gen).to(kv_dtype)
        v_cache = torch.randn(k_cache.shape, device=device, generator=gen).to(kv_dtype)
        q = torch.randn(query_len, args.num_heads, args.head_dim, device=device, generator=gen).to(dtype)
        tables = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)[None]
        cu = torch.tensor([0, query_len], dtype=torch.int32, device=device)
        lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
        pairs = query_len * context_len + query_len * (query_len + 1) / 2
        flops = 4 * args.num_heads * args.head_dim * pairs
        default = default_prefill_config(args.head_dim, dtype, group, args.block_size, q.device)
        candidates = [("default", default)] + [
            (f"{m}x{n} w{w} s{s} h{h} {'tma' if t else 'gather'}", PrefillConfig(m, n, w, s, heads=h, tma=t))
            for m, n, w, s, h, t in configs if group % h == 0 and (not t or args.block_size % n == 0)]
        if args.default_only:  # the default against the same tiling with every key's row gathered
            candidates.append(("default, gathered", dataclasses.replace(default, tma=False)))
        reference = None
        for label, config in candidates:
            call = functools.partial(prefill_attention, q, k_cache, v_cache, tables, cu, lens,
                                     args.head_dim**-0.5, query_len, config=config, k_scale=k_scale,
                                     v_scale=v_scale)
            try:
                out = call()
            except triton.runtime.errors.OutOfResources as error:  # a tiling this GPU's shared memory cannot hold
                print(f"{label}: skipped ({error})")
                continue
            if reference is None:
                reference = out
            else:  # every tiling computes the same attention
                torch.testing.assert_close(out, reference, atol=2e-2, rtol=2e-2)
            if args.smoke:
                ms = 0.0
            else:
                ms = triton.testing.do_bench(call, warmup=5, rep=30)
            tflops = flops / (ms * 1e-3) / 1e12 if ms else 0.0
            rows.append(dict(query_len=query_len, context_len=context_len, config=label, ms=round(ms, 3),
                             tflops=round(tflops, 1), fraction_of_peak=round(tflops / PEAK_TFLOPS, 3)))
    print(f"KV cache {args.kv_cache_dtype}")
    print(f"{'queries':>8}{'context':>9}  {'config':<30}{'ms':>9}{'TFLOP/s':>9}{'of peak':>9}")
    for r in rows:
        print(f"{r['query_len']:>8}{r['context_len']:>9}  {r['config']:<30}{r['ms']:>9.3f}{r['tflops']:>9.1f}"
              f"{r['fraction_of_peak']:>9.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
