"""Where a decode step's time goes at a given batch size: the engine's whole step against its device work.

For each batch size B: B random prompts of --context tokens decode together (greedy or sampled, EOS ignored),
and the script reports
- engine ms/step: wall time of the engine's decode-only steps (host planning + device, as a user sees them);
- in-engine graph ms: the device time of the decode graph inside those steps (CUDA events around each replay);
- graph ms: the decode graph of that batch replayed alone, back to back, at --context keys in distinct blocks
  (distinct_key_blocks) and without K/V stores;
- head ms: LM head + sampler on B rows, alone (device time);
- kernels: the kernels one graph replay launches, and the costliest by device time (torch.profiler).
engine - (in-engine graph + head) is what the device waits for the host. JSON to --out. --host-profile runs
the engine's steps of the largest batch once more under cProfile and prints where the host's time goes.

    python benchmarks/decode_step.py --batch-sizes 1 8 64 256 --context 512
    python benchmarks/decode_step.py --batch-sizes 256 --host-profile 25
    python benchmarks/decode_step.py --batch-sizes 256 --step-trace 20

--step-trace runs them under torch.profiler instead: how much of the steps' wall time the device was busy, the
kernels it ran (inside and outside the graph) and the CUDA calls the host made, each by total time.
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

import torch  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.attention.metadata import AttentionMetadata, forward_context  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL = os.path.join(HERE, "model_configs", "qwen3-0.6b")


def engine_ms_per_decode_step(llm: LLM, batch: int, context: int, steps: int, temperature: float,
                              profiler=None) -> tuple[float, float]:
    """(median wall time of the engine's decode-only steps while `batch` requests decode together, median
    device time of the decode graph's replays in them, nan without graphs); a given cProfile profiler runs during
    the steps only."""
    random.seed(batch)
    top = min(10000, llm.hf_config.vocab_size - 1)
    prompts = [[random.randint(0, top) for _ in range(context)] for _ in range(batch)]
    params = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=steps)
    for prompt in prompts:
        llm.add_request(prompt, params)
    runner = getattr(llm.runner, "runner", llm.runner)
    graphs = runner.graphs if torch.cuda.is_available() else None
    replays: list[tuple] = []
    if graphs is not None:
        replay = graphs.replay

        def timed_replay(step):  # events on the stream around each replay of the engine's own steps
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            hidden = replay(step)
            end.record()
            replays.append((step.input_ids.shape[0], start, end))
            return hidden

        graphs.replay = timed_replay
    times = []
    try:
        while llm.has_unfinished_requests():
            start = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            llm.step()
            if profiler is not None:
                profiler.disable()
            elapsed = time.perf_counter() - start
            last = llm.last_step
            if not last.prefill_tokens and last.decode_tokens == batch:
                times.append(elapsed)
    finally:
        if graphs is not None:
            del graphs.replay  # the class's method again
    if graphs is not None:
        torch.cuda.synchronize()
    graph_times = [start.elapsed_time(end) for rows, start, end in replays if rows == batch]
    return 1e3 * _median(times), _median(graph_times)


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def time_on_device(fn, repeats: int) -> float:
    """ms per call of fn, back to back on the stream, by CUDA events."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def kernel_table(fn, top: int) -> tuple[int, list[dict]]:
    """(kernels launched by one call of fn, the costliest kernels by total device time over that call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    count = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            count += 1
            entry = per_name[event.name]
            entry[0] += 1
            entry[1] += event.device_time_total  # us
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]
    return count, [{"kernel": name[:90], "calls": n, "us": round(us, 1)} for name, (n, us) in rows]


def distinct_key_blocks(runner, size: int, context: int) -> None:
    """Give the first `size` rows of the decode graphs' block tables distinct blocks for `context` keys each, as a
    real batch has (rows left sharing blocks read part of their keys from L2 and flatter the graph)."""
    graphs = runner.graphs
    used = min(graphs.block_tables.shape[1], -(-context // runner.block_size))
    if size * used > runner.num_kvcache_blocks:
        raise SystemExit(f"{size} requests x {used} blocks of keys need more than the pool's "
                         f"{runner.num_kvcache_blocks} blocks: fewer requests or shorter contexts")
    graphs.block_tables[:size] = 0
    graphs.block_tables[:size, :used] = torch.arange(size * used, dtype=torch.int32,
                                                     device=graphs.block_tables.device).view(size, used)


def device_breakdown(llm: LLM, runner, batch: int, engine_ms: float, engine_graph_ms: float, args) -> dict:
    """The decode graph of `batch` rows, the LM head + sampler, and the eager forward, each alone on the device."""
    from nanovllm.layers.sampler import SamplingTensors

    graphs = runner.graphs
    parts = {}
    size = next(s for s in graphs.sizes if s >= batch)
    distinct_key_blocks(runner, size, args.context)
    graphs.seq_lens[:batch].fill_(args.context)
    graphs.slot_mapping[:size].fill_(-1)  # write no KV
    graph = graphs.graphs[size]
    hidden = torch.randn(batch, llm.hf_config.hidden_size, device="cuda", dtype=runner.model.lm_head.weight.dtype)
    temperatures = torch.full((batch,), args.temperature, device="cuda")
    params = SamplingTensors(temperatures=temperatures, all_greedy=args.temperature == 0,
                             row_seeds=torch.arange(batch, device="cuda"))
    generator = torch.Generator(device="cuda")

    def head():
        runner.sampler(runner.model.compute_logits(hidden), params, generator)

    parts["graph_ms"] = round(time_on_device(graph.replay, args.repeats), 3)
    parts["head_ms"] = round(time_on_device(head, args.repeats), 3)
    parts["host_exposed_ms"] = round(engine_ms - engine_graph_ms - parts["head_ms"], 3)
    parts["graph_kernels"], parts["graph_top"] = kernel_table(graph.replay, args.top_kernels)
    parts["head_kernels"], parts["head_top"] = kernel_table(head, args.top_kernels)
    # the forward without the graph, eager, to see launch overhead
    meta = AttentionMetadata(
        slot_mapping=graphs.slot_mapping[:batch], cu_seqlens_q=graphs.cu_seqlens_q[:batch + 1],
        seq_lens=graphs.seq_lens[:batch], block_tables=graphs.block_tables[:batch], num_decodes=batch,
        num_decode_tokens=batch, max_query_len=1, max_seq_len=args.max_model_len,
        query_lens_host=[1] * batch, seq_lens_host=[args.context] * batch)

    runner.backend.prepare(meta, runner.block_size)

    def eager():
        with torch.inference_mode(), forward_context(meta):
            runner.model(graphs.input_ids[:batch], graphs.positions[:batch])

    parts["eager_ms"] = round(time_on_device(eager, 10), 3)
    return parts


def print_host_profile(llm: LLM, batch: int, args) -> None:
    """The engine's steps of `batch` requests under cProfile: the costliest functions by their own time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    ms, _ = engine_ms_per_decode_step(llm, batch, args.context, args.steps, args.temperature, profiler)
    print(f"\nhost profile, batch {batch}, {args.steps} steps ({ms:.3f} ms/step under the profiler):")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.host_profile)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.host_profile)


def print_step_trace(llm: LLM, batch: int, args) -> None:
    """The engine's steps of `batch` requests under torch.profiler: device busy share, kernels, host CUDA calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ms, _ = engine_ms_per_decode_step(llm, batch, args.context, args.steps, args.temperature)
        torch.cuda.synchronize()
    device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    intervals = sorted((e.time_range.start, e.time_range.end) for e in device)
    busy, reach = 0.0, float("-inf")
    for start, end in intervals:  # the union of kernel intervals
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    wall = intervals[-1][1] - intervals[0][0] if intervals else 0.0
    print(f"\nstep trace, batch {batch}, {args.steps} steps ({ms:.3f} ms/step median under the profiler): device "
          f"busy {busy / 1e3:.1f} of {wall / 1e3:.1f} ms ({busy / max(wall, 1):.0%})")
    for title, events in (("device kernels", device),
                          ("host CUDA calls", [e for e in prof.events()
                                               if e.device_type == torch.autograd.DeviceType.CPU
                                               and e.name.startswith("cuda")])):
        totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
        for e in events:
            totals[e.name][0] += 1
            totals[e.name][1] += e.time_range.end - e.time_range.start
        print(f"{title}:")
        for name, (calls, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:args.step_trace]:
            print(f"  {us / 1e3:>9.2f} ms {calls:>6} x  {name[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--context", type=int, default=512, help="prompt tokens of each request")
    parser.add_argument("--steps", type=int, default=64, help="tokens each request generates")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--top-kernels", type=int, default=12)
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="profile the largest batch's steps with cProfile and print the N costliest functions")
    parser.add_argument("--step-trace", type=int, default=0, metavar="N",
                        help="trace the largest batch's steps with torch.profiler and print the N costliest "
                             "device kernels and host CUDA calls")
    parser.add_argument("--out", default="results/decode_step.json")
    args, engine_args = parser.parse_known_args()
    extra = {}
    for flag in engine_args:  # --key=value pairs go to LLM as they are (ints and floats parsed)
        key, _, value = flag.lstrip("-").partition("=")
        extra[key.replace("-", "_")] = int(value) if value.isdigit() else value

    llm = LLM(args.model, load_format="dummy", max_model_len=args.max_model_len,
              max_num_seqs=max(args.batch_sizes), **extra)
    runner = getattr(llm.runner, "runner", llm.runner)
    graphs = runner.graphs
    results = []
    for batch in args.batch_sizes:
        engine_ms, engine_graph_ms = engine_ms_per_decode_step(llm, batch, args.context, args.steps,
                                                               args.temperature)
        row = dict(batch=batch, context=args.context, engine_ms=round(engine_ms, 3),
                   engine_graph_ms=round(engine_graph_ms, 3))
        if graphs is not None and torch.cuda.is_available():
            row.update(device_breakdown(llm, runner, batch, engine_ms, engine_graph_ms, args))
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_top")}), flush=True)

    print(f"\n{'batch':>6}{'engine ms':>11}{'in-engine graph ms':>20}{'graph ms':>10}{'head ms':>9}{'host ms':>9}"
          f"{'eager ms':>10}{'kernels':>9}")
    for r in results:
        print(f"{r['batch']:>6}{r['engine_ms']:>11.3f}{r['engine_graph_ms']:>20.3f}{r.get('graph_ms', float('nan')):>10.3f}"
              f"{r.get('head_ms', float('nan')):>9.3f}{r.get('host_exposed_ms', float('nan')):>9.3f}"
              f"{r.get('eager_ms', float('nan')):>10.3f}{r.get('graph_kernels', 0):>9}")
    for r in results:
        for part in ("graph_top", "head_top"):
            if r.get(part):  # --top-kernels 0: no tables
                print(f"\nbatch {r['batch']}, {part[:-4]}: " + "".join(
                    f"\n  {k['us']:>9.1f} us {k['calls']:>4} x  {k['kernel']}" for k in r[part]))
    if args.host_profile:
        print_host_profile(llm, max(args.batch_sizes), args)
    if args.step_trace and torch.cuda.is_available():
        print_step_trace(llm, max(args.batch_sizes), args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    llm.close()


if __name__ == "__main__":
    main()
