"""The few-row GEMM (kernels/skinny_gemm.py) against the library's (F.linear) at decode shapes, on one GPU.

Each measurement is a CUDA graph of one product per layer over --layers distinct weights (as a decode step
reads them: none is in L2 when its turn comes), replayed; the figure is microseconds per product and the
weight bytes read per second, with the default tiling and with it reading no weight before its wait on the
kernel before (prefetch_k=0). --sweep tries tile configurations besides the default and reports the best.
--fp8 compares, for quantization="fp8" (e4m3 weights, a scale per output row), the bf16 product the engine
would run against: the activations quantized by torch ops or by the one-kernel quantizer, then
torch._scaled_mm or our fp8 Triton GEMM (kernels/fp8_gemm.py; with --sweep, its tilings besides the default);
and for up to 16 rows the few-row GEMM over the e4m3 weight with e4m3 or bf16 activations.

    python benchmarks/skinny_gemm.py --rows 1 8 16 --out results/skinny_gemm.json
    python benchmarks/skinny_gemm.py --sweep --out results/skinny_sweep.json
    python benchmarks/skinny_gemm.py --fp8 --rows 1 8 16 64 256 --out results/fp8_linear.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanovllm.kernels.fp8 import quantize_rows_e4m3  # noqa: E402
from nanovllm.kernels.fp8_gemm import Fp8GemmConfig, fp8_linear  # noqa: E402
from nanovllm.kernels.skinny_gemm import MAX_ROWS, SkinnyConfig, default_config, skinny_linear, takes  # noqa: E402
from nanovllm.layers.quantization.fp8 import quantize_rows  # noqa: E402

# (name, N, K, gated) of one layer: Qwen3-0.6B and Qwen3-8B (TP=1)
SHAPES = [("0.6b qkv", 4096, 1024, False), ("0.6b o", 1024, 2048, False), ("0.6b gate_up", 3072, 1024, True),
          ("0.6b down", 1024, 3072, False), ("8b qkv", 6144, 4096, False), ("8b o", 4096, 4096, False),
          ("8b gate_up", 12288, 4096, True), ("8b down", 4096, 12288, False)]


def graph_us(fn_per_layer, layers: int, replays: int = 20) -> float:
    """Microseconds per product: a graph of `layers` products (one per weight), replayed."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(layers):
            fn_per_layer(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            fn_per_layer(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (replays * layers)


def library(x, weight, gated):
    y = F.linear(x, weight)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y


def bf16_product(x, weight, gated):
    """What the engine runs for a bf16 weight: the few-row kernel where it takes the product, else the library."""
    if takes(x, weight, gated):
        return skinny_linear(x, weight, gated=gated)
    return library(x, weight, gated)


def scaled_mm_product(x, weight, scale, gated, quantize):
    x_fp8, x_scale = quantize(x)
    y = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y


# tilings of the fp8 Triton GEMM that --fp8 --sweep tries: (block_m, block_n, block_k, warps, stages[, split_k])
FP8_GEMM_SWEEP = [(64, 64, 128, 4, 5), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4), (128, 64, 128, 8, 5),
                  (128, 128, 128, 8, 4), (128, 128, 64, 8, 5), (64, 256, 128, 8, 3), (128, 256, 128, 8, 3),
                  (64, 128, 128, 4, 4, 2), (128, 64, 128, 4, 4, 2), (128, 128, 128, 8, 4, 2), (128, 128, 128, 8, 4, 3),
                  (128, 128, 128, 8, 4, 4), (128, 256, 128, 8, 3, 2)]


def triton_fp8_product(x, weight, scale, gated, config=None):
    x_fp8, x_scale = quantize_rows_e4m3(x)
    y = fp8_linear(x_fp8, x_scale, weight, scale.view(-1), None, x.dtype, config)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y


def few_row_fp8_product(x, weight, scale, gated, fp8_activations, config=None):
    if not fp8_activations:
        return skinny_linear(x, weight, gated=gated, weight_scale=scale.view(-1), config=config)
    x_fp8, x_scale = quantize_rows_e4m3(x)
    return skinny_linear(x_fp8, weight, gated=gated, weight_scale=scale.view(-1), x_scale=x_scale,
                         out_dtype=x.dtype, config=config)


def layer_weights(args, device):
    """(name, N, K, gated, one bf16 weight per layer) of each shape asked for; a shape's weights are freed after."""
    for name, n, k, gated in SHAPES:
        if args.shapes and name not in args.shapes:
            continue
        rows_total = 2 * n if gated else n
        layers = max(2, min(args.layers, int(6e9 // (rows_total * k * 2))))
        weights = [torch.randn(rows_total, k, device=device, dtype=torch.bfloat16) / k ** 0.5 for _ in range(layers)]
        yield name, n, k, gated, weights
        weights.clear()
        torch.cuda.empty_cache()


def fp8_variants(x, weights, quantized, gated, sweep: bool) -> dict:
    """label -> fn(layer index) of each way to run the product of x with one layer's weight."""
    variants = {
        "bf16": lambda i: bf16_product(x, weights[i], gated),
        "fp8 torch-quant + scaled_mm": lambda i: scaled_mm_product(x, *quantized[i], gated, quantize_rows),
        "fp8 kernel-quant + scaled_mm": lambda i: scaled_mm_product(x, *quantized[i], gated, quantize_rows_e4m3),
        "fp8 kernel-quant + triton": lambda i: triton_fp8_product(x, *quantized[i], gated),
    }
    for tiling in FP8_GEMM_SWEEP if sweep else ():
        for tma in (True, False):
            config = Fp8GemmConfig(*tiling[:5], tma=tma, split_k=tiling[5] if len(tiling) > 5 else 1)
            variants[f"triton {tiling}{' tma' if tma else ''}"] = \
                lambda i, c=config: triton_fp8_product(x, *quantized[i], gated, c)
    if x.shape[0] <= MAX_ROWS:
        variants["fp8 few-row, e4m3 x"] = lambda i: few_row_fp8_product(x, *quantized[i], gated, True)
        variants["fp8 few-row, bf16 x"] = lambda i: few_row_fp8_product(x, *quantized[i], gated, False)
        # the tiles of a 16-bit weight (half the bytes a tile): what the e4m3 default doubles
        n = weights[0].shape[0] // (2 if gated else 1)
        narrow = default_config(n, x.shape[1], x.device, gated)
        variants["fp8 few-row, bf16 x, 16-bit tiles"] = lambda i: few_row_fp8_product(x, *quantized[i], gated,
                                                                                       False, narrow)
    return variants


def fp8_main(args, device) -> list[dict]:
    results = []
    for name, n, k, gated, weights in layer_weights(args, device):
        layers = len(weights)
        quantized = [quantize_rows(w) for w in weights]
        for m in args.rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            expect = library(x, weights[0], gated)
            variants = fp8_variants(x, weights, quantized, gated, args.sweep)
            row = dict(shape=name, n=n, k=k, gated=gated, rows=m)
            for label, fn in variants.items():
                try:
                    error = ((fn(0).float() - expect.float()).norm() / expect.float().norm()).item()
                    # a gated output multiplies two fp8 products (silu(gate) * up): about twice one product's error
                    limit = 0.08 if gated else 0.05
                    assert error < limit, f"relative error {error:.3f} against bf16 (limit {limit})"
                    row[label] = round(graph_us(fn, layers), 2)
                except Exception as error:
                    print(f"  {name} m={m} {label}: {type(error).__name__}: {str(error)[:160]}")
            swept = {key: value for key, value in row.items() if key.startswith("triton (")}
            if swept:
                row["best triton tiling"] = min(swept, key=swept.get)
            results.append(row)
            print(f"{name:<13} m={m:<4} " + "  ".join(f"{key} {value:7.2f}" for key, value in row.items()
                                                      if isinstance(value, float) and key not in swept)
                  + (f"  best {row['best triton tiling']} {swept[row['best triton tiling']]:.2f}" if swept else ""),
                  flush=True)
        quantized.clear()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--shapes", nargs="+", default=None, help="names from SHAPES (default: all)")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--fp8", action="store_true", help="compare the fp8 linear layer's products (see above)")
    parser.add_argument("--out", default="results/skinny_gemm.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    if args.fp8:
        results = fp8_main(args, device)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        return
    results = []
    for name, n, k, gated, weights in layer_weights(args, device):
        layers = len(weights)
        nbytes = weights[0].numel() * 2
        for m in args.rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            expect = library(x, weights[0], gated)
            configs = [default_config(n, k, device, gated)]
            # the default without its weight read before the wait on the kernel before (prefetch_k=0)
            configs.append(dataclasses.replace(configs[0], prefetch_k=0))
            if args.sweep:
                base = configs[0].split_k
                for block_n, block_k, split, stages, warps in itertools.product(
                        (32, 64, 128), (128, 256), sorted({max(1, base // 2), base, base * 2}), (3,), (4,)):
                    configs.append(SkinnyConfig(block_n, block_k, split, warps, stages))
            lib_us = graph_us(lambda i, x=x, w=weights, g=gated: library(x, w[i], g), layers)
            best = None
            for config in configs:
                try:
                    got = skinny_linear(x, weights[0], gated=gated, config=config)
                    torch.testing.assert_close(got, expect, rtol=3e-2, atol=3e-2)
                    us = graph_us(lambda i, x=x, w=weights, g=gated, c=config: skinny_linear(x, w[i], gated=g, config=c), layers)
                except Exception as error:  # a config that does not compile or fit: say so, go on
                    print(f"  {name} m={m} {config}: {type(error).__name__}: {str(error)[:100]}")
                    continue
                if best is None or us < best[0]:
                    best = (us, config)
                if config is configs[0]:
                    default_us = us
                if config is configs[1]:
                    no_prefetch_us = us
            row = dict(shape=name, n=n, k=k, gated=gated, rows=m, library_us=round(lib_us, 2),
                       skinny_us=round(default_us, 2), no_prefetch_us=round(no_prefetch_us, 2), library_tbps=round(nbytes / lib_us / 1e6, 2),
                       skinny_tbps=round(nbytes / default_us / 1e6, 2), best_us=round(best[0], 2),
                       best_config=best[1].__dict__)
            results.append(row)
            print(f"{name:<13} m={m:<3} library {lib_us:7.2f} us ({row['library_tbps']:.2f} TB/s)  skinny "
                  f"{default_us:7.2f} us ({row['skinny_tbps']:.2f} TB/s)  no prefetch {no_prefetch_us:7.2f}  best {best[0]:7.2f} us {best[1]}",
                  flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
