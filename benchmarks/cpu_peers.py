"""CPU throughput against the peers a laptop user would pick: HF transformers `generate` and llama.cpp.

One run measures, on the same chat prompts (greedy, --max-tokens new tokens, EOS ignored):

- nanovllm, one request at a time (``--num-single`` of them) and all ``--num-concurrent`` at once, once per
  ``--engine-args`` configuration (e.g. ``--engine-args '{}' --engine-args '{"cpu_int8": true}'``);
- HF transformers ``generate`` in float32, batch 1 (``--num-single``) and one left-padded batch of ``--hf-batch``;
- llama.cpp through llama-cpp-python, one request at a time (``--num-single``), on the same GGUF file.

Throughput = generated tokens / wall time (prefill included), after one warm-up call per engine. With
``--repeat N`` every part runs N times, interleaved (llama.cpp's too: it stays loaded in its worker process), and
the best time counts (the machine may be shared, and its speed drifts); each of our parts starts from an empty
prefix cache. The JSON keeps every repetition's figure.
Prints a table and our ratio to each peer (of the best times, and repetition by repetition: each repetition's
parts run minutes apart at most, the best times may come from different minutes), and writes JSON.

llama-cpp-python lives in its own environment: ``--llama-python /path/to/python`` (default: $LLAMA_PYTHON,
else /tmp/peers-venv/bin/python, else this interpreter) runs the llama.cpp part in a subprocess of that
interpreter, which needs llama_cpp and nothing of this project. When it has no llama_cpp the peer is skipped.

    pip install llama-cpp-python   # in its own venv; builds from source in about 5 minutes
    python benchmarks/cpu_peers.py --llama-python /tmp/peers-venv/bin/python --repeat 3 --out results/cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

TOPICS = ["the sea", "volcanoes", "honey bees", "the moon", "bread", "rivers", "chess", "trains",
          "glaciers", "owls", "coffee", "libraries", "deserts", "violins", "clouds", "bicycles"]
TASKS = ["Write a short story about {}.", "Explain how {} work to a child.", "List five facts about {}.",
         "Write a poem about {}."]
DEFAULT_LLAMA_PYTHON = "/tmp/peers-venv/bin/python"


def questions(count: int) -> list[str]:
    """`count` distinct chat questions (16 topics x 4 tasks, then repeating with a number)."""
    base = [task.format(topic) for task in TASKS for topic in TOPICS]
    return [base[i % len(base)] + (f" ({i // len(base) + 1})" if i >= len(base) else "") for i in range(count)]


def load_note() -> dict:
    """The machine's load right now: a figure taken under load says so."""
    one, five, _ = os.getloadavg()
    return {"load1": round(one, 2), "load5": round(five, 2)}


# -- nanovllm --------------------------------------------------------------------------------------------------
def config_label(engine_args: str) -> str:
    """A short name of one --engine-args configuration, e.g. 'cpu_int8'."""
    config = json.loads(engine_args)
    return ",".join(k if v is True else f"{k}={v}" for k, v in config.items()) or "defaults"


def run_nanovllm(args, prompts: list[list[int]], engine_args: str) -> dict:
    import resource

    import torch

    from nanovllm import LLM, SamplingParams
    from nanovllm.platforms.cpu import cpu_ops

    llm = LLM(args.model, **json.loads(engine_args))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], warm, use_tqdm=False)

    # every part starts from an empty prefix cache: a repetition must not find the previous one's prompts cached
    # (requests within a part still share what earlier ones left, as llama.cpp reuses its previous prompt's prefix)
    def single() -> tuple[int, float]:
        llm.reset_prefix_cache()
        tokens, seconds = 0, 0.0
        for p in prompts[:args.num_single]:
            start = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
            seconds += time.perf_counter() - start
            tokens += len(out[0].token_ids)
        return tokens, seconds

    def concurrent() -> tuple[int, float]:
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:args.num_concurrent]], params, use_tqdm=False)
        return sum(len(o.token_ids) for o in outs), time.perf_counter() - start

    runner = getattr(llm.runner, "runner", llm.runner)
    ops = cpu_ops.load()
    # what this build runs, which the machine's flags do not say (a library built with -mno-avx512f, torch with
    # ATEN_CPU_CAPABILITY=avx2 on an AVX512 machine)
    info = {"dtype": str(runner.dtype), "threads": torch.get_num_threads(),
            "block_size": llm.config.kvcache_block_size,
            "block_kernel": cpu_ops.BLOCKS_SIMD[ops.linear_blocks_simd()] if ops is not None else None,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}
    name = "nanovllm" + (f" [{config_label(engine_args)}]" if len(args.engine_args) > 1 else "")
    return {"name": name, "parts": {f"{name} single": single, f"{name} {args.num_concurrent} concurrent": concurrent},
            "info": info, "maxrss": lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


# -- HF transformers -------------------------------------------------------------------------------------------
def run_hf(args, prompts: list[list[int]], model_path: str, pad_id: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
                                                 dtype=torch.float32)
    model.eval()
    # EOS ignored: no stop token, always max_new_tokens
    gen = dict(do_sample=False, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
               pad_token_id=pad_id)

    @torch.inference_mode()
    def generate(batch: list[list[int]]) -> int:
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(input_ids=ids, attention_mask=mask, **gen)
        return (out.shape[1] - width) * len(batch)

    with torch.inference_mode():
        model.generate(input_ids=torch.tensor([prompts[0]]), do_sample=False, max_new_tokens=4, pad_token_id=pad_id)

    def single() -> tuple[int, float]:
        start = time.perf_counter()
        tokens = sum(generate([p]) for p in prompts[:args.num_single])
        return tokens, time.perf_counter() - start

    def padded() -> tuple[int, float]:
        start = time.perf_counter()
        tokens = generate(prompts[:args.hf_batch])
        return tokens, time.perf_counter() - start

    return {"parts": {"HF generate batch 1": single, f"HF generate padded batch {args.hf_batch}": padded}}


# -- llama.cpp (in its own interpreter) ------------------------------------------------------------------------
LLAMA_WORKER = r"""
import json, sys, time
job = json.loads(sys.stdin.readline())
try:
    import llama_cpp
except ImportError as e:
    print(json.dumps({"error": f"no llama_cpp in {sys.executable}: {e}"}), flush=True); sys.exit(0)
llm = llama_cpp.Llama(model_path=job["model"], n_ctx=job["n_ctx"], n_threads=job["threads"],
                      n_threads_batch=job["threads"], n_batch=512, verbose=False, seed=0)

def one(prompt, max_tokens):
    out = []  # generate(reset=True) reuses the longest common prefix with the previous prompt, as our prefix cache does
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(token)
        if len(out) == max_tokens:  # EOS ignored: stop only at max_tokens
            break
    return out

one(job["prompts"][0], 8)
print(json.dumps({"version": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode()}),
      flush=True)
for _ in sys.stdin:  # one line per repetition, answered by [tokens, seconds]
    tokens, seconds = 0, 0.0
    for p in job["prompts"]:
        start = time.perf_counter()
        tokens += len(one(p, job["max_tokens"]))
        seconds += time.perf_counter() - start
    print(json.dumps([tokens, seconds]), flush=True)
"""


def find_llama_python(requested: str | None) -> str:
    return requested or os.environ.get("LLAMA_PYTHON") or (
        DEFAULT_LLAMA_PYTHON if os.path.exists(DEFAULT_LLAMA_PYTHON) else sys.executable)


class LlamaCpp:
    """llama.cpp in a worker process of its own Python, loaded once; ``single()`` runs one repetition of the
    one-at-a-time part there, so its repetitions interleave with the other engines' (the machine's speed drifts)."""

    def __init__(self, args, prompts: list[list[int]], model_path: str):
        self.python = find_llama_python(args.llama_python)
        job = {"model": model_path, "prompts": prompts[:args.num_single], "max_tokens": args.max_tokens,
               "threads": args.threads, "n_ctx": max(map(len, prompts)) + args.max_tokens + 8}
        self.info: dict = {}
        try:
            self.process = subprocess.Popen([self.python, "-c", LLAMA_WORKER], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        except OSError as e:
            self.error = f"cannot run {self.python}: {e}"
            return
        self.process.stdin.write(json.dumps(job) + "\n")
        self.info = self._reply() or {"error": f"{self.python} failed: {self.process.stderr.read().strip()[-500:]}"}
        self.error = self.info.get("error")
        self.info["python"] = self.python

    def _reply(self):
        line = self.process.stdout.readline()
        return json.loads(line) if line.strip() else None

    def single(self) -> tuple[int, float]:
        self.process.stdin.write("run\n")
        reply = self._reply()
        if reply is None:
            raise RuntimeError(f"the llama.cpp worker died: {self.process.stderr.read().strip()[-500:]}")
        return reply[0], reply[1]

    def close(self) -> None:
        if getattr(self, "process", None) is not None:
            self.process.stdin.close()
            self.process.wait(timeout=60)


# -- the run ---------------------------------------------------------------------------------------------------
def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
    except (OSError, StopIteration):
        return []
    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-single", type=int, default=4, help="requests run one at a time, per engine")
    parser.add_argument("--num-concurrent", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of every engine")
    parser.add_argument("--repeat", type=int, default=1, help="run every part this many times; the best counts")
    parser.add_argument("--llama-python", default=None, help="a python with llama_cpp (see above)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["nanovllm", "hf", "llama.cpp"])
    parser.add_argument("--engine-args", action="append", default=None,
                        help="extra LLM(...) keyword arguments as JSON; give it several times to compare "
                             "configurations in one call (the machine's speed drifts between calls)")
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    args = parser.parse_args()
    args.engine_args = args.engine_args or ["{}"]

    import torch

    from nanovllm.loader.default_model import embedded_model_path

    torch.set_num_threads(args.threads)
    args.model = args.model or embedded_model_path()
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(args.model), gguf_file=os.path.basename(args.model))
    count = max(args.num_single, args.num_concurrent, args.hf_batch)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in questions(count)]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    engines = {}
    rss = None
    if "nanovllm" not in args.skip:
        for engine_args in args.engine_args:
            engine = run_nanovllm(args, prompts, engine_args)
            engines[engine["name"]] = engine
    if "hf" not in args.skip:
        engines["hf"] = run_hf(args, prompts, args.model, pad_id)
    llama = None
    if "llama.cpp" not in args.skip:
        llama = LlamaCpp(args, prompts, args.model)
        if llama.error:
            print(f"llama.cpp skipped: {llama.error}")
        else:
            engines["llama.cpp"] = {"parts": {"llama.cpp single": llama.single}}

    best: dict[str, dict] = {}
    runs: dict[str, list[float]] = {}  # tok/s of every repetition
    for _ in range(args.repeat):
        for engine in engines.values():
            for name, part in engine["parts"].items():
                before = load_note()
                tokens, seconds = part()
                row = {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "load_before": before,
                       "load_after": load_note()}
                print(f"  {name}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s "
                      f"(load {before['load1']})", flush=True)
                runs.setdefault(name, []).append(round(row["tok_s"], 2))
                if name not in best or row["tok_s"] > best[name]["tok_s"]:
                    best[name] = row
        ours = [e for e in engines.values() if "maxrss" in e]
        if ours:
            rss = ours[0]["maxrss"]()  # the process's peak: every configuration's engine lives in it

    if llama is not None:
        llama.close()

    print(f"\n{'engine / mode':<48}{'tokens':>8}{'seconds':>10}{'tok/s':>10}")
    for name, row in best.items():
        print(f"{name:<48}{row['tokens']:>8}{row['seconds']:>10.2f}{row['tok_s']:>10.1f}")
    ratios = {}
    targets = [("single", "llama.cpp single", 0.8), ("concurrent", "llama.cpp single", 8.0),
               ("concurrent", f"HF generate padded batch {args.hf_batch}", 4.0),
               ("single", "HF generate batch 1", None)]
    print()
    for name in [e["name"] for e in engines.values() if "name" in e]:
        parts = {"single": f"{name} single", "concurrent": f"{name} {args.num_concurrent} concurrent"}
        ours = {mine: best.get(part) for mine, part in parts.items()}
        for mine, peer, target in targets:
            if ours[mine] and peer in best:
                ratio = ours[mine]["tok_s"] / best[peer]["tok_s"]
                key = f"{name} {mine} / {peer}"
                # each repetition's pair ran minutes apart at most: less exposed to the machine's drift than
                # the best of each, which may come from different minutes
                paired = [a / b for a, b in zip(runs[parts[mine]], runs[peer])]
                ratios[key] = {"ratio": ratio, "target": target, "met": None if target is None else ratio >= target,
                               "per_repetition": [round(r, 3) for r in paired]}
                goal = "" if target is None else f"  (target >= {target}x: {'met' if ratio >= target else 'NOT met'})"
                print(f"{key:<64}{ratio:>7.2f}x{goal}")
                if len(paired) > 1:
                    print(f"{'':<8}by repetition: {' / '.join(f'{r:.2f}x' for r in paired)}, "
                          f"median {statistics.median(paired):.2f}x")

    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "cpu_flags": cpu_flags(), "torch": torch.__version__, "model": args.model,
        "max_tokens": args.max_tokens, "prompt_tokens": [len(p) for p in prompts[:count]],
        "threads": args.threads, "repeat": args.repeat, "results": best, "runs_tok_s": runs, "ratios": ratios,
        "engine_args": args.engine_args,
        "nanovllm": {e["name"]: e["info"] for e in engines.values() if "name" in e} or None,
        "nanovllm_peak_rss_bytes": rss,
        "llama_cpp": llama.info if llama is not None else None,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
