"""The host's share of a decode step: microseconds of Python per step and per decoding request.

B requests of --context prompt tokens decode together on a tiny random model on the CPU (also on a GPU machine),
with asynchronous scheduling on (as on CUDA: the next step is planned while the one before runs) and CUDA's KV
block size. The forward, the LM head and the sampler are the device's work: they are timed apart and taken out,
so what is left is what the host does per step (scheduling, the batch's arrays, the sampling tensors,
postprocessing, stop checks). With --outputs the caller also builds every request's DELTA output each step (as
an in-process streaming caller does). CUDA's own host work (copies to pinned memory, graph replay, kernel
launches) is not in it.

    python benchmarks/host_step.py --batch-sizes 8 64 256
    python benchmarks/host_step.py --batch-sizes 256 --profile 25   # cProfile's top functions

Prints a table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.sampling_params import RequestOutputKind  # noqa: E402


class DeviceTimer:
    """Wraps the runner's device work (forward, LM head, sampler) and sums its wall time."""

    def __init__(self, runner):
        self.seconds = 0.0
        for owner, name in ((runner, "_forward"), (runner.model, "compute_logits"), (runner, "sampler")):
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def measure(llm: LLM, timer: DeviceTimer, batch: int, args, profiler: cProfile.Profile | None) -> dict:
    random.seed(batch)
    vocab = llm.llm_engine.vocab_size
    # every request still decodes while the measured steps run: the last ones admitted start that many steps later
    prefill_steps = -(-batch * args.context // llm.llm_engine.config.max_num_batched_tokens) + 1
    params = SamplingParams(temperature=args.temperature, ignore_eos=True,
                            max_tokens=prefill_steps + args.warmup + args.steps + 2, output_kind=RequestOutputKind.DELTA)
    ids = [llm.add_request([random.randint(3, vocab - 1) for _ in range(args.context)], params)
           for _ in range(batch)]
    engine = llm.llm_engine
    host, steps = [], 0
    while llm.has_unfinished_requests():
        device_before = timer.seconds
        measured = steps >= args.warmup and len(host) < args.steps
        if measured and profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        llm.step()
        if args.outputs:
            for request_id in ids:
                if request_id in engine.requests:
                    output = engine.make_output(request_id)
                    if output.finished:
                        engine.forget_request(request_id)
        elapsed = time.perf_counter() - start
        if measured and profiler is not None:
            profiler.disable()
        last = llm.last_step
        if not last.prefill_tokens and last.decode_tokens == batch:
            steps += 1
            if measured:
                host.append(elapsed - (timer.seconds - device_before))
        if len(host) == args.steps:
            break
    for request_id in ids:
        llm.abort_request(request_id)
    while llm.has_unfinished_requests():  # a step planned ahead of the aborts
        llm.step()
    host.sort()
    median = host[len(host) // 2]
    return {"batch": batch, "steps": len(host), "host_us_per_step": round(1e6 * median, 1),
            "host_us_per_request": round(1e6 * median / batch, 2),
            "host_us_p10": round(1e6 * host[len(host) // 10], 1), "host_us_p90": round(1e6 * host[9 * len(host) // 10], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--context", type=int, default=512, help="prompt tokens of each request")
    parser.add_argument("--steps", type=int, default=60, help="decode steps measured per batch size")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--block-size", type=int, default=256, help="KV block size (CUDA's default)")
    parser.add_argument("--sync", action="store_true", help="asynchronous scheduling off")
    parser.add_argument("--outputs", action="store_true", help="also build each request's output every step")
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's top N functions (the largest batch)")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default="results/host_step.json")
    args = parser.parse_args()

    from tests.helpers import save_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        model = save_tiny_model("qwen3", folder)
        max_len = args.context + args.warmup + args.steps + 64
        llm = LLM(model, max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=max(4096, max_len),
                  max_model_len=max_len, kvcache_block_size=args.block_size,
                  num_kvcache_blocks=max(args.batch_sizes) * (-(-max_len // args.block_size) + 1),
                  async_scheduling=not args.sync, enforce_eager=True, device="cpu")
        timer = DeviceTimer(getattr(llm.runner, "runner", llm.runner))
        results = []
        for batch in args.batch_sizes:
            profiler = cProfile.Profile() if args.profile and batch == max(args.batch_sizes) else None
            results.append(measure(llm, timer, batch, args, profiler))
            if profiler is not None:
                pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
        llm.close()

    print(f"host work per decode step ({'sync' if args.sync else 'async'} scheduling, temperature "
          f"{args.temperature}, context {args.context}{', outputs built' if args.outputs else ''}) {args.label}")
    print("| batch | host us/step (p10-p90) | host us/request |")
    print("|---:|---:|---:|")
    for r in results:
        print(f"| {r['batch']} | {r['host_us_per_step']} ({r['host_us_p10']}-{r['host_us_p90']}) | "
              f"{r['host_us_per_request']} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
