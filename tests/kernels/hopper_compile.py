"""Compile the engine's Triton kernels for Hopper (sm_90) on a machine without a GPU: Triton's compiler runs on
the CPU down to a cubin, and it checks what the interpreter lets pass (a loop-carried variable changing shape,
a global it cannot read). Run as a module, without TRITON_INTERPRET (test_compile_for_hopper.py does): one line
per kernel configuration, exit status 1 if any failed.

The configurations are those the launchers choose for the Qwen3-0.6B shape (and an fp8 variant of each kernel that
has one), taken from their default-config functions where those need no GPU (decode attention, fused MoE) and
written out otherwise; a pointer's element type is named per argument, other arguments are int32 unless they are
scales.
"""

from __future__ import annotations

import sys
import traceback

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nanovllm.kernels import (
    decode_attention,
    fp8_block_gemm,
    fp8_gemm,
    fused_moe,
    prefill_attention,
    rms_norm,
    rope_store,
    sampling,
    skinny_gemm,
    store_kvcache,
)
from nanovllm.kernels.fp8 import _quantize_rows_kernel, _silu_and_mul_quantize_rows_kernel

HOPPER = GPUTarget("cuda", 90, 32)
FLOAT_ARGS = {"eps", "scale_log2", "v_scale", "k_inv_scale", "v_inv_scale"}


def sampling_cases():
    yield ("sampling: chunk argmax (Gumbel)", sampling._chunk_argmax_kernel,
           dict(logits_ptr="*fp32", temperatures_ptr="*fp32", seeds_ptr="*i64", scores_ptr="*fp32", ids_ptr="*i32"),
           dict(BLOCK=1024, FAST_LOG=True), dict(num_warps=4))
    yield ("sampling: chunks reduced", sampling._reduce_chunks_kernel,
           dict(scores_ptr="*fp32", ids_ptr="*i32", out_ptr="*i64", best_score_ptr="*fp32"),
           dict(BLOCK_CHUNKS=sampling._REDUCE_BLOCK), dict(num_warps=4))


def compile_for_hopper(fn, pointers: dict[str, str], constexprs: dict, **options):
    """triton.compile of fn for sm_90: pointers names each pointer argument's type ('*bf16'; or a tensor
    descriptor's, 'tensordesc<bf16[64,128]>'), constexprs every constexpr argument's value (None too)."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr") or name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(name),): value for name, value in constexprs.items()})
    return triton.compile(source, target=HOPPER, options=options)


def skinny_cases():
    pointers = dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", w_scale_ptr="*fp32", x_scale_ptr="*fp32",
                    out_ptr="*bf16", partial_ptr="*fp32", counter_ptr="*i32")
    base = dict(HAS_BIAS=False, GATED=False, W_SCALED=False, X_SCALED=False, SPLIT_K=2, BLOCK_M=skinny_gemm.MAX_ROWS,
                BLOCK_N=32, BLOCK_K=128, UPCAST=False, HEAD_K=512, OVERLAP=True)
    yield "skinny qkv, read ahead", pointers, base
    yield "skinny qkv, no read ahead", pointers, {**base, "HEAD_K": 0}
    yield "skinny gate_up + SiLU", pointers, {**base, "GATED": True, "SPLIT_K": 1, "BLOCK_K": 256, "HEAD_K": 256}
    yield "skinny e4m3 weight", {**pointers, "w_ptr": "*fp8e4nv"}, {**base, "W_SCALED": True, "BLOCK_K": 256}
    yield "skinny e4m3 weight and x", {**pointers, "w_ptr": "*fp8e4nv", "x_ptr": "*fp8e4nv"}, \
        {**base, "W_SCALED": True, "X_SCALED": True, "BLOCK_K": 256, "HEAD_K": 0}


def moe_cases():
    """The alignment's three kernels and the grouped GEMM (gate/up with SiLU-and-mul, down with the routing weight)
    at the Qwen3-30B-A3B shape's 128 experts."""
    chunk, block_e = fused_moe.ALIGN_CHUNK, 128
    yield ("moe: count", fused_moe._moe_count_kernel,
           dict(topk_ids_ptr="*i64", chunk_counts_ptr="*i32", rank_ptr="*i32"), dict(CHUNK=chunk, BLOCK_E=block_e),
           dict(num_warps=4))
    yield ("moe: offsets", fused_moe._moe_offsets_kernel,
           dict(chunk_counts_ptr="*i32", expert_starts_ptr="*i32", sorted_ids_ptr="*i32", block_experts_ptr="*i32",
                num_padded_ptr="*i32"),
           dict(BLOCK_M=16, BLOCK_E=block_e, CHUNKS_PER_STEP=max(16, 8192 // block_e),
                BLOCKS_PER_STEP=max(16, 8192 // block_e), FILL=1024), dict(num_warps=4))
    yield ("moe: scatter", fused_moe._moe_scatter_kernel,
           dict(topk_ids_ptr="*i64", chunk_counts_ptr="*i32", rank_ptr="*i32", expert_starts_ptr="*i32",
                sorted_ids_ptr="*i32"), dict(CHUNK=chunk), dict(num_warps=4))
    pointers = dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", routing_weights_ptr="*fp32", sorted_ids_ptr="*i32",
                    block_experts_ptr="*i32", num_padded_ptr="*i32")
    for gated, tokens in ((True, 16), (False, 4096)):
        config = fused_moe.default_block_config(tokens)
        yield (f"moe: grouped GEMM, gated {gated}, {tokens} tokens", fused_moe._moe_grouped_gemm_kernel, pointers,
               dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GATED=gated,
                    WEIGHTED=not gated, DOT_PRECISION="tf32"),
               dict(num_warps=config.num_warps, num_stages=config.num_stages))


def cases():
    for name, pointers, constexprs in skinny_cases():
        yield name, skinny_gemm._skinny_gemm_kernel, pointers, constexprs, dict(num_warps=4, num_stages=3)
    norm_pointers = dict(x_ptr="*bf16", residual_ptr="*bf16", weight_ptr="*bf16", out_ptr="*bf16",
                         residual_out_ptr="*bf16", scale_ptr="*bf16")
    for residual in (False, True):
        yield (f"rms_norm, residual {residual}", rms_norm._add_rms_norm_kernel, norm_pointers,
               dict(BLOCK=1024, HAS_RESIDUAL=residual, QUANTIZE=False, OVERLAP=True), dict(num_warps=4))
        yield (f"rms_norm to e4m3, residual {residual}", rms_norm._add_rms_norm_kernel,
               dict(norm_pointers, out_ptr="*fp8e4nv", scale_ptr="*fp32"),
               dict(BLOCK=4096, HAS_RESIDUAL=residual, QUANTIZE=True, OVERLAP=False), dict(num_warps=8))
    for cache in ("*bf16", "*fp8e4nv"):
        fp8 = cache != "*bf16"
        config = decode_attention.default_decode_config(128, torch.float8_e4m3fn if fp8 else torch.bfloat16)
        yield (f"decode split, {cache} cache", decode_attention._decode_split_kernel,
               dict(q_ptr="*bf16", k_cache_ptr=cache, v_cache_ptr=cache, block_tables_ptr="*i32", seq_lens_ptr="*i32",
                    out_ptr="*bf16", partial_max_ptr="*fp32", partial_sum_ptr="*fp32", partial_acc_ptr="*fp32"),
               dict(NUM_HEADS=16, GROUP=2, BLOCK_GROUP=16, HEAD_DIM=128, BLOCK_SIZE=256, BLOCK_N=config.block_n,
                    WRITE_OUT=False, DOT_PRECISION="tf32", KV_FP8=fp8, V_ASM_UPCAST=fp8,
                    COMPUTE=tl.float16 if fp8 else tl.bfloat16, OVERLAP=True),
               config.launch_options())
        yield (f"rope/store, {cache} cache", rope_store._norm_rope_store_kernel,
               dict(qkv_ptr="*bf16", positions_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", q_weight_ptr="*bf16",
                    k_weight_ptr="*bf16", q_out_ptr="*bf16", k_cache_ptr=cache, v_cache_ptr=cache,
                    slot_mapping_ptr="*i64"),
               dict(NUM_HEADS=16, NUM_KV_HEADS=8, BLOCK_HEADS=16, BLOCK_KV_HEADS=8, HEAD_DIM=128, NORM=True, FP8=fp8,
                    OVERLAP=True),
               dict(num_warps=4))
    for cache, tma in (("*bf16", True), ("*bf16", False), ("*fp8e4nv", True)):
        fp8 = cache != "*bf16"
        pointers = dict(q_ptr="*bf16", k_cache_ptr=cache, v_cache_ptr=cache, block_tables_ptr="*i32",
                        cu_seqlens_q_ptr="*i32", seq_lens_ptr="*i32", out_ptr="*bf16")
        constexprs = dict(GROUP=2, HEAD_DIM=128, BLOCK_SIZE=256, DOT_PRECISION="tf32", KV_FP8=fp8,
                          COMPUTE=tl.float16 if fp8 else tl.bfloat16, TMA=tma)
        if tma:  # the default where a cache block holds whole tiles
            tile = 64  # the tiles of a 16-bit q, whatever the cache (default_prefill_config)
            pointers.update(k_desc=f"tensordesc<{cache[1:]}[{tile},128]>", v_desc=f"tensordesc<{cache[1:]}[{tile},128]>")
            constexprs.update(BLOCK_M=64, BLOCK_N=tile, HEADS=2)
            options = dict(num_warps=4, num_stages=3)
        else:  # gathered rows
            constexprs.update(k_desc=None, v_desc=None, BLOCK_M=128, BLOCK_N=128, HEADS=1)
            options = dict(num_warps=8, num_stages=2)
        yield f"prefill, {cache} cache, tma {tma}", prefill_attention._prefill_attention_kernel, pointers, constexprs, \
            options
    for cache in ("*bf16", "*fp8e4nv"):
        yield (f"store_kvcache, {cache} cache", store_kvcache._store_kvcache_kernel,
               dict(key_ptr="*bf16", value_ptr="*bf16", k_cache_ptr=cache, v_cache_ptr=cache, slot_mapping_ptr="*i64"),
               dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, FP8=cache != "*bf16"), dict(num_warps=4))
    yield ("fp8 rows quantized", _quantize_rows_kernel, dict(x_ptr="*bf16", out_ptr="*fp8e4nv", scale_ptr="*fp32"),
           dict(BLOCK=1024), dict(num_warps=4))
    for dtype in ("*bf16", "*fp16"):
        yield (f"fp8 SwiGLU rows quantized, {dtype}", _silu_and_mul_quantize_rows_kernel,
               dict(x_ptr=dtype, out_ptr="*fp8e4nv", scale_ptr="*fp32"), dict(BLOCK=2048), dict(num_warps=8))
    yield from sampling_cases()
    yield from moe_cases()
    yield ("fp8 block-scaled GEMM", fp8_block_gemm._block_fp8_gemm_kernel,
           dict(x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", y_ptr="*bf16", x_scale_ptr="*fp32", w_scale_ptr="*fp32"),
           dict(GROUP_K=128, BLOCK_M=16, BLOCK_N=fp8_block_gemm.BLOCK_N, UPCAST=False), dict(num_warps=4, num_stages=3))
    for tma, split_k in ((True, 1), (False, 1), (True, 3)):
        pointers = dict(x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", y_ptr="*bf16", x_scale_ptr="*fp32", w_scale_ptr="*fp32",
                        bias_ptr="*bf16", partial_ptr="*fp32", counter_ptr="*i32")
        constexprs = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, SPLIT_K=split_k, TMA=tma, HAS_BIAS=True,
                          UPCAST=False)
        if tma:
            pointers.update(x_desc="tensordesc<fp8e4nv[64,128]>", w_desc="tensordesc<fp8e4nv[128,128]>")
        else:
            constexprs.update(x_desc=None, w_desc=None)
        yield (f"fp8 GEMM, tma {tma}, split K {split_k}", fp8_gemm._fp8_gemm_kernel, pointers, constexprs,
               dict(num_warps=4, num_stages=4))
    yield ("decode reduce", decode_attention._decode_reduce_kernel,
           dict(partial_max_ptr="*fp32", partial_sum_ptr="*fp32", partial_acc_ptr="*fp32", out_ptr="*bf16"),
           dict(NUM_HEADS=16, HEAD_DIM=128, BLOCK_SPLITS=16, OVERLAP=True), dict(num_warps=4))


def main() -> int:
    failed = 0
    for name, fn, pointers, constexprs, options in cases():
        try:
            compile_for_hopper(fn, pointers, constexprs, **options)
            print(f"ok: {name}", flush=True)
        except Exception as error:  # report every configuration, then fail
            failed += 1
            message = str(error).strip().splitlines()
            print(f"FAILED: {name}: {type(error).__name__}: {message[-1] if message else ''}", flush=True)
            traceback.print_exc(limit=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
