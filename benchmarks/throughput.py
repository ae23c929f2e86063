"""Offline throughput on the standard workloads (W1: nano-vllm's benchmark, W2: fixed lengths).

Prints a table (requests, prompt tokens, output tokens, seconds, output tok/s, fraction of the roofline
ceiling) and writes JSON. Throughput = generated tokens / wall time of the whole generate call, after one
warm-up call. Random weights (load_format="dummy") from a config.json; random token ids.

    python benchmarks/throughput.py --workload W1 W2 --out results/throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.card import (  # noqa: E402
    H200_COPY_BANDWIDTH,
    H200_MATMUL_FLOPS,
    measured_copy_bandwidth,
    measured_matmul_flops,
)
from nanovllm import LLM, SamplingParams  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL = os.path.join(HERE, "model_configs", "qwen3-0.6b")


def workload(name: str, num_requests: int):
    random.seed(0)
    if name == "W1":
        prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(num_requests)]
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(100, 1024))
                  for _ in range(num_requests)]
    elif name == "W2":
        prompts = [[random.randint(0, 10000) for _ in range(512)] for _ in range(num_requests)]
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=512)] * num_requests
    else:
        raise ValueError(f"unknown workload {name!r}; choose W1 or W2")
    return prompts, params


def expected_experts_hit(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts a step of `tokens` tokens reads, when each token picks top_k of them at random."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


class Roofline:
    """What a workload must move and multiply: every decode step reads the weights and each live request's K/V
    once; every token multiplies by the weights it passes.

    Mixture of experts: a decode step reads the dense weights (attention, router, dense layers, LM head) and,
    in each sparse layer, only the experts its tokens picked (expected distinct experts of `running` tokens
    routed at random; at 256 requests x 8 of 128 experts that is nearly all); a token's FLOPs count its top_k
    experts. With tensor parallelism the work is spread over that many GPUs, so their bandwidth and FLOPs add up.
    """

    def __init__(self, llm: LLM):
        from nanovllm.layers.fused_moe import FusedExperts

        cfg = llm.hf_config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * llm.config.kv_torch_dtype.itemsize
        model = getattr(llm.runner, "runner", llm.runner).model
        self.gpus = llm.config.tensor_parallel_size
        weight_params = sum(p.numel() for p in model.parameters())  # a tied embedding counts once, as the LM head
        if not model.tie_word_embeddings:
            # a step reads only its tokens' rows of an input embedding of its own (Qwen3-8B: 0.6 G of 8.2 G params)
            weight_params -= model.model.embed_tokens.weight.numel()
        expert_layers = [m for m in model.modules() if isinstance(m, FusedExperts)]
        expert_params = sum(m.w13_weight.numel() + m.w2_weight.numel() for m in expert_layers)
        self.dense_params = (weight_params - expert_params) * self.gpus
        self.expert_layers = len(expert_layers)
        self.num_experts = expert_layers[0].num_experts if expert_layers else 0
        self.top_k = getattr(cfg, "num_experts_per_tok", 0) if expert_layers else 0
        # of one expert of one layer
        self.per_expert = expert_params * self.gpus / (self.expert_layers * self.num_experts) if expert_layers else 0
        # fp8: the linear layers' (the LM head stays 16-bit)
        self.weight_bytes = 1 if llm.config.quantization == "fp8" else 2

    def step_bytes(self, requests: int, context_tokens: int) -> float:
        """Bytes a decode step of `requests` requests with `context_tokens` tokens of context in all reads: its
        weights (in a sparse layer, the experts they pick) and their K/V."""
        hit = expected_experts_hit(self.num_experts, self.top_k, requests) if self.expert_layers else 0
        weights = self.dense_params + self.expert_layers * hit * self.per_expert
        return weights * self.weight_bytes + context_tokens * self.kv_bytes

    def seconds(self, prompts, params, bandwidth: float, flops: float) -> tuple[float, float]:
        """(memory floor, compute floor) of a workload in seconds at the given bandwidth (bytes/s) and bf16 FLOP/s
        of one GPU."""
        kv_reads = sum(len(p) * sp.max_tokens + sp.max_tokens * (sp.max_tokens - 1) // 2
                       for p, sp in zip(prompts, params))
        lengths = sorted(sp.max_tokens for sp in params)
        weight_reads = 0.0
        for step in range(lengths[-1]):  # all requests fit at once on the card; those still running read weights
            running = len(lengths) - next((i for i, n in enumerate(lengths) if n > step), len(lengths))
            weight_reads += self.step_bytes(running, 0)
        memory = (kv_reads * self.kv_bytes + weight_reads) / (bandwidth * self.gpus)
        tokens = sum(len(p) + sp.max_tokens for p, sp in zip(prompts, params))
        active_params = self.dense_params + self.expert_layers * self.top_k * self.per_expert
        compute = 2 * active_params * tokens / (flops * self.gpus)
        return memory, compute


class StepProfiler:
    """Times the parts of each engine step (synchronising the device around each), when asked to."""

    def __init__(self, llm: LLM):
        import torch

        self.totals = defaultdict(float)
        self.sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        runner = getattr(llm.runner, "runner", llm.runner)
        import nanovllm.engine.model_runner as mr
        self._wrap(llm.scheduler, "schedule", "schedule")
        self._wrap(llm.scheduler, "postprocess", "postprocess")
        self._wrap_module(mr, "prepare_batch", "prepare inputs")
        self._wrap(runner, "_forward", "forward (eager)")
        if runner.graphs is not None:
            self._wrap(runner.graphs, "replay", "forward (graph)")
        if runner.piecewise is not None:
            self._wrap(runner.piecewise, "replay", "forward (pieces)")
        self._wrap(runner.model, "compute_logits", "logits")
        self._wrap(runner, "sampler", "sample")

    def _timed(self, fn, label):
        def wrapper(*args, **kwargs):
            self.sync()
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            self.sync()
            self.totals[label] += time.perf_counter() - start
            return result
        return wrapper

    def _wrap(self, obj, attr, label):
        setattr(obj, attr, self._timed(getattr(obj, attr), label))

    def _wrap_module(self, module, attr, label):
        setattr(module, attr, self._timed(getattr(module, attr), label))

    def report(self, wall: float) -> dict:
        rows = dict(sorted(self.totals.items(), key=lambda kv: -kv[1]))
        print(f"{'part of step':<20}{'seconds':>10}{'share':>8}")
        for label, seconds in rows.items():
            print(f"{label:<20}{seconds:>10.2f}{seconds / wall:>8.1%}")
        return rows


def _batch_bucket(batch: int) -> str:
    """'1-8', '9-16', '17-32', ...: power-of-two ranges of decode batch sizes."""
    high = 8
    while batch > high:
        high *= 2
    return f"{1 if high == 8 else high // 2 + 1}-{high}"


class StepTimer:
    """Wall time of the engine's steps by kind (with prefill tokens, decode only); adds no device syncs.

    Given a Roofline and a bandwidth (bytes/s), each decode-only step also gets its floor: the bytes of its
    weights and of its requests' K/V (their lengths as the step starts) at that bandwidth."""

    def __init__(self, llm: LLM, roofline: Roofline | None = None, bandwidth: float | None = None):
        self.llm = llm
        self.totals = {"prefill": [0, 0.0], "decode": [0, 0.0]}
        self.prefill_step_seconds: list[float] = []
        # decode-only steps by batch size: [steps, seconds, floor seconds]; shows whether small batches (the tail of
        # a workload, where the host's part of a step is no longer hidden behind the GPU's) cost more than their share
        self.by_batch: dict[str, list] = defaultdict(lambda: [0, 0.0, 0.0])
        self.roofline, self.bandwidth = (roofline, bandwidth) if roofline and bandwidth else (None, None)
        self._step = llm.step
        llm.step = self.step

    def step(self):
        floor = None
        if self.roofline is not None:
            running = self.llm.scheduler.running
            floor = self.roofline.step_bytes(len(running), sum(map(len, running))) / (
                self.bandwidth * self.roofline.gpus)
        start = time.perf_counter()
        result = self._step()
        seconds = time.perf_counter() - start
        kind = "prefill" if self.llm.last_step.prefill_tokens else "decode"
        self.totals[kind][0] += 1
        self.totals[kind][1] += seconds
        if kind == "prefill":
            self.prefill_step_seconds.append(round(seconds, 4))
        else:
            bucket = self.by_batch[_batch_bucket(self.llm.last_step.decode_tokens)]
            bucket[0] += 1
            bucket[1] += seconds
            bucket[2] += floor or 0.0
        return result

    def report(self) -> dict:
        def bucket(n: int, t: float, floor: float) -> dict:
            row = {"steps": n, "seconds": round(t, 3), "ms_per_step": round(1e3 * t / n, 2)}
            if self.roofline is not None:
                row |= {"floor_ms_per_step": round(1e3 * floor / n, 2), "floor_fraction": round(floor / t, 3)}
            return row

        return {f"{kind}_steps": count for kind, (count, _) in self.totals.items()} | {
            f"{kind}_step_seconds": round(seconds, 3) for kind, (_, seconds) in self.totals.items()} | {
            "each_prefill_step_seconds": self.prefill_step_seconds,
            "decode_steps_by_batch": {b: bucket(*v) for b, v in sorted(self.by_batch.items(), key=lambda kv: int(
                kv[0].split("-")[0]))}}

    def close(self) -> None:
        self.llm.step = self._step


def start_kernel_profiler():
    """torch.profiler recording host and device activity until report_kernel_profile."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = profile(activities=activities)
    profiler.__enter__()
    return profiler


def report_kernel_profile(profiler) -> None:
    """Stop the profiler; print the 25 costliest operations by device time (host time without a GPU)."""
    import torch

    profiler.__exit__(None, None, None)
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(profiler.key_averages().table(sort_by=key, row_limit=25))


def fp8_engine_options(args) -> dict:
    """Sets the fp8 linear layers' options that an A/B run changes (before the engine is built); returns them for
    the JSON."""
    from nanovllm.layers.quantization.fp8 import Fp8LinearMethod
    if args.fp8_norm_e4m3 is not None:
        Fp8LinearMethod.norm_hands_e4m3_rows = args.fp8_norm_e4m3
    if args.fp8_triton_gemm_rows:
        Fp8LinearMethod.triton_gemm_rows = tuple(args.fp8_triton_gemm_rows)
    return dict(fp8_norm_e4m3=Fp8LinearMethod.norm_hands_e4m3_rows, fp8_triton_gemm_rows=Fp8LinearMethod.triton_gemm_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a folder with config.json (random weights)")
    parser.add_argument("--workload", nargs="+", default=["W1", "W2"], choices=["W1", "W2"])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--cudagraph-mode", default="full_and_piecewise",
                        help="full_and_piecewise, full_decode_only, piecewise or none")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--kvcache-block-size", type=int, default=256)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, choices=["fp8"], help="fp8 weights and activations")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's) or fp8 (e4m3, a scale per layer)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="plan each step while the one before runs (default: the engine's, on with one GPU)")
    parser.add_argument("--disable-custom-all-reduce", action="store_true",
                        help="tensor parallelism: NCCL for every all-reduce")
    parser.add_argument("--gather-logits", action="store_true",
                        help="tensor parallel: gather the logits and sample on rank 0 even when every rank could "
                             "sample on its slice of the vocabulary (to measure what slice sampling saves)")
    parser.add_argument("--profile", action="store_true", help="report where a step's time goes")
    parser.add_argument("--kernel-profile", action="store_true",
                        help="torch.profiler over each workload: the top device kernels by total time (adds "
                             "profiler overhead to the figures)")
    parser.add_argument("--fp8-norm-e4m3", action=argparse.BooleanOptionalAction, default=None,
                        help="quantization fp8: whether the norms before qkv_proj / gate_up_proj hand them e4m3 rows "
                             "(Fp8LinearMethod.norm_hands_e4m3_rows, on by default; one GPU: the engine's own "
                             "process)")
    parser.add_argument("--fp8-triton-gemm-rows", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                        help="quantization fp8: products of LO-HI rows in the Triton fp8 GEMM instead of cuBLAS "
                             "(Fp8LinearMethod.triton_gemm_rows; one GPU)")
    parser.add_argument("--out", default="results/throughput.json")
    args = parser.parse_args()
    fp8_options = fp8_engine_options(args)

    # this card's ceilings, before the engine takes its memory (None off CUDA); the workloads' recorded ceilings
    # are an H200's
    card_copy, card_flops = measured_copy_bandwidth(), measured_matmul_flops()
    llm = LLM(args.model, load_format="dummy", enforce_eager=args.enforce_eager,
              cudagraph_mode=args.cudagraph_mode, tensor_parallel_size=args.tensor_parallel_size, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kvcache_block_size=args.kvcache_block_size, device=args.device, dtype=args.dtype,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
              async_scheduling=args.async_scheduling, disable_custom_all_reduce=args.disable_custom_all_reduce)
    if args.gather_logits and args.tensor_parallel_size > 1:
        llm.runner.disable_slice_sampling = True
    # one warm-up call that touches the shapes the workloads will (prefill chunks, mixed and decode steps)
    warm_prompts, warm_params = workload("W1", 32)
    llm.generate(warm_prompts, [SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True)] * 32,
                 use_tqdm=False)

    roofline = Roofline(llm)
    results = []
    for name in args.workload:
        prompts, params = workload(name, args.num_requests)
        profiler = StepProfiler(llm) if args.profile else None
        timer = StepTimer(llm, roofline, card_copy or H200_COPY_BANDWIDTH)
        kernel_profiler = start_kernel_profiler() if args.kernel_profile else None
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        timer.close()
        if kernel_profiler is not None:
            report_kernel_profile(kernel_profiler)
        generated = sum(len(o.token_ids) for o in outputs)
        ceiling = generated / sum(roofline.seconds(prompts, params, H200_COPY_BANDWIDTH, H200_MATMUL_FLOPS))
        card = {}
        if card_copy and card_flops:
            card_ceiling = generated / sum(roofline.seconds(prompts, params, card_copy, card_flops))
            card = dict(card_copy_tbps=round(card_copy / 1e12, 2), card_matmul_tflops=round(card_flops / 1e12, 1),
                        card_ceiling_tok_s=round(card_ceiling, 1),
                        fraction_of_card_ceiling=round(generated / seconds / card_ceiling, 3))
        row = dict(workload=name, requests=len(prompts), prompt_tokens=sum(map(len, prompts)),
                   output_tokens=generated, seconds=round(seconds, 3), output_tok_s=round(generated / seconds, 1),
                   ceiling_tok_s=round(ceiling, 1), fraction_of_ceiling=round(generated / seconds / ceiling, 3),
                   enforce_eager=args.enforce_eager, cudagraph_mode=args.cudagraph_mode,
                   tensor_parallel_size=args.tensor_parallel_size,
                   custom_all_reduce=args.tensor_parallel_size > 1 and not args.disable_custom_all_reduce,
                   slice_sampling=args.tensor_parallel_size > 1 and not args.gather_logits,
                   preemptions=llm.scheduler.stats.num_preemptions, kv_blocks=llm.num_kvcache_blocks,
                   async_scheduling=llm.async_scheduling, model=os.path.basename(os.path.normpath(args.model)),
                   **fp8_options, **card, **timer.report())
        if profiler:
            row["profile_seconds"] = profiler.report(seconds)
        results.append(row)

    header = (f"{'workload':<9}{'requests':>9}{'prompt tok':>12}{'output tok':>12}{'seconds':>9}{'out tok/s':>11}"
              f"{'H200 ceiling':>14}{'fraction':>9}{'card ceiling':>14}{'fraction':>9}")
    print(header)
    for r in results:
        print(f"{r['workload']:<9}{r['requests']:>9}{r['prompt_tokens']:>12}{r['output_tokens']:>12}{r['seconds']:>9.2f}"
              f"{r['output_tok_s']:>11,.0f}{r['ceiling_tok_s']:>14,.0f}{r['fraction_of_ceiling']:>9.2f}"
              f"{r.get('card_ceiling_tok_s', float('nan')):>14,.0f}{r.get('fraction_of_card_ceiling', float('nan')):>9.2f}")
        if "card_copy_tbps" in r:
            print(f"{'':<9}this card: copy {r['card_copy_tbps']} TB/s, bf16 matmul {r['card_matmul_tflops']} TFLOP/s "
                  f"(the H200 ceiling's: {H200_COPY_BANDWIDTH / 1e12} TB/s, {H200_MATMUL_FLOPS / 1e12:.0f} TFLOP/s)")
        print(f"{'':<9}steps with prefill: {r['prefill_steps']} in {r['prefill_step_seconds']:.2f} s; "
              f"decode-only: {r['decode_steps']} in {r['decode_step_seconds']:.2f} s; "
              f"async scheduling {'on' if r['async_scheduling'] else 'off'}; each step with prefill (s): "
              f"{r['each_prefill_step_seconds']}")
        print(f"{'':<9}decode-only steps by batch size: " + "; ".join(
            f"{b}: {d['steps']} x {d['ms_per_step']} ms (floor {d['floor_ms_per_step']})"
            for b, d in r["decode_steps_by_batch"].items()))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    llm.close()


if __name__ == "__main__":
    main()
