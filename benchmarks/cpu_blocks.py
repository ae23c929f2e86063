"""The CPU's 4/8-bit block products (platforms/cpu/cpu_ops.linear_blocks) alone, at the embedded SmolLM2's shapes.

Times, per row count and activation passes, the products of all 30 layers' four 4-bit weights (qkv 960 x 576,
o 576 x 576, gate_up 3072 x 576, down 576 x 1536; ~66 MB with their scales, so each call reads them from memory, as a decode step
does) and of the 8-bit LM head (49152 x 576), and the bytes of weights read per second. Random weights in the
blocks' exact format; the library this machine's build gives (NANOVLLM_CACHE_DIR and CC choose another build).

    python benchmarks/cpu_blocks.py --rows 1 2 64 --out results/cpu_blocks.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from nanovllm.platforms.cpu import cpu_ops  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of SmolLM2-135M's qkv, o, gate_up, down
LAYERS = 30
LM_HEAD = (49152, 576)


def exact_4bit(out_features: int, in_features: int) -> cpu_ops.BlockWeight:
    """A weight that is exactly GGUF Q4_0 blocks (q = 0 at each block's largest magnitude, -8 d)."""
    q = torch.randint(0, 16, (out_features, in_features // 32, 32)).float()
    q[..., 0] = 0
    d = (torch.rand(out_features, in_features // 32, 1) * 0.01 + 0.001).half().float()
    return cpu_ops.block_weight((d * q + (-8 * d).half().float()).reshape(out_features, in_features), 4)


def weight_bytes(weight: cpu_ops.BlockWeight) -> int:
    return sum(t.numel() * t.element_size() for t in (weight.tiles, weight.d, weight.m) if t is not None)


def in_features(weight: cpu_ops.BlockWeight) -> int:
    """A tile holds 16 outputs by every input: 8 inputs a 4-bit row of 4 bytes, 4 an 8-bit one."""
    return weight.tiles.shape[1] * (8 if weight.bits == 4 else 4)


def time_products(weights: list, rows: int, passes: int, repeats: int) -> float:
    inputs = [torch.randn(rows, in_features(w)) for w in weights]

    def run():
        for x, w in zip(inputs, weights):
            cpu_ops.linear_blocks(x, w, None, None, passes)
    run()
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 64])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="results/cpu_blocks.json")
    args = parser.parse_args()
    if cpu_ops.load() is None:
        sys.exit("the CPU's compiled ops are not available here (no C compiler, or NANOVLLM_CPU_KERNELS=0)")
    torch.manual_seed(0)
    layers = [exact_4bit(*shape) for _ in range(LAYERS) for shape in LAYER_SHAPES]  # distinct: read from memory
    assert [(w.d.shape[0] * 16, in_features(w)) for w in layers[:4]] == LAYER_SHAPES
    sets = {"layers, 4-bit": layers, "lm head, 8-bit": [cpu_ops.block_weight(torch.randn(*LM_HEAD) * 0.05, 8)]}
    results = []
    print(f"block kernel: {cpu_ops.load().linear_blocks_simd()} (2 AVX512-VNNI, 1 AVX2, 0 plain C); "
          f"threads {torch.get_num_threads()}")
    print(f"{'weights':<16}{'rows':>6}{'passes':>8}{'ms':>9}{'GB/s':>8}")
    for name, weights in sets.items():
        nbytes = sum(map(weight_bytes, weights))
        for rows in args.rows:
            for passes in (1, 2):
                seconds = time_products(weights, rows, passes, args.repeats)
                results.append(dict(weights=name, rows=rows, passes=passes, ms=round(seconds * 1e3, 3),
                                    weight_gb_s=round(nbytes / seconds / 1e9, 1)))
                print(f"{name:<16}{rows:>6}{passes:>8}{seconds * 1e3:>9.2f}{nbytes / seconds / 1e9:>8.1f}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(block_kernel=cpu_ops.load().linear_blocks_simd(), threads=torch.get_num_threads(),
                       results=results), f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
