"""Resident memory of `nanovllm serve` (defaults unless --serve-args), front end and engine core, after each phase.

Starts the server from the checkout given (--tree, default this one) on the embedded model, and reads each
process's VmRSS from /proc (Linux) at start, after --chat-requests concurrent chat requests of --chat-tokens
tokens (EOS ignored), and after --prompt-waves waves of 32 concurrent completions of distinct ~600-token prompts
(4 tokens each). Prints one JSON line per phase: the front end, the core (the largest child), their sum, the
other children (multiprocessing's resource tracker) and whether the front end has torch mapped; and each one's
peak since the start (VmHWM, the core's reset once it is up, so loading is left out), which catches what a
burst of prefills holds while it runs (their sum bounds the pair's peak from above).

    python benchmarks/server_memory.py --prompt-waves 10      # as in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MODEL_NAME = "SmolLM2-135M-Instruct"
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def prompt(i: int, words: int = 200) -> str:
    """A distinct prompt of ~590 tokens (200 words each with a number) for request i."""
    return f"{i}: " + " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] + str((i * j) % 97) for j in range(words))


def vm_rss_mb(pid: int, key: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) // 1024
    raise RuntimeError(f"no {key} for {pid}")


def reset_peak(pid: int) -> None:
    """Start the process's VmHWM afresh from its resident size now (Linux: clear_refs 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def report(server: subprocess.Popen, phase: str) -> dict:
    sizes = {pid: vm_rss_mb(pid) for pid in children(server.pid)}
    core = max(sizes, key=sizes.get)
    front = vm_rss_mb(server.pid)
    if phase == "start":
        reset_peak(core)
    peaks = vm_rss_mb(server.pid, "VmHWM"), vm_rss_mb(core, "VmHWM")
    row = dict(phase=phase, front_end_mb=front, core_mb=sizes[core], sum_mb=front + sizes[core],
               front_end_peak_mb=peaks[0], core_peak_mb=peaks[1], peak_sum_mb=sum(peaks),
               others_mb=[v for k, v in sizes.items() if k != core],
               front_end_has_torch="libtorch" in Path(f"/proc/{server.pid}/maps").read_text())
    print(json.dumps(row), flush=True)
    return row


async def load(url: str, server: subprocess.Popen, args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        async def post(path: str, body: dict) -> None:
            response = await client.post(path, json=dict(body, model=MODEL_NAME))
            response.raise_for_status()

        start = time.perf_counter()
        await asyncio.gather(*[post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"Tell me a story about number {i}."}],
            "max_tokens": args.chat_tokens, "ignore_eos": True}) for i in range(args.chat_requests)])
        print(f"chat: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        report(server, f"after {args.chat_requests} x {args.chat_tokens} chat")
        start = time.perf_counter()
        for wave in range(args.prompt_waves):
            await asyncio.gather(*[post("/v1/completions", {"prompt": prompt(wave * 32 + i), "max_tokens": 4})
                                   for i in range(32)])
        if args.prompt_waves:
            count = (await client.post("/tokenize", json={"model": MODEL_NAME, "prompt": prompt(0)})).json()["count"]
            print(f"prompts: {time.perf_counter() - start:.1f} s, {count} tokens each", file=sys.stderr, flush=True)
            report(server, f"after {args.prompt_waves * 32} prompts")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]), help="checkout to serve from")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--chat-requests", type=int, default=64)
    parser.add_argument("--chat-tokens", type=int, default=128)
    parser.add_argument("--prompt-waves", type=int, default=10, help="waves of 32 completions (10: 320 prompts)")
    parser.add_argument("--serve-args", default="", help="more flags for nanovllm serve, as one string")
    args = parser.parse_args()
    log = tempfile.NamedTemporaryFile("w+", prefix="nanovllm-serve-", suffix=".log", delete=False)
    env = dict(os.environ, PYTHONPATH=args.tree, HF_HUB_OFFLINE="1")
    server = subprocess.Popen([sys.executable, "-m", "nanovllm.server.serve", "--port", str(args.port),
                               "--no-access-log", "--log-level", "warning", *args.serve_args.split()],
                              cwd=args.tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{args.port}"
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited with {server.returncode}:\n{Path(log.name).read_text()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        time.sleep(1)
        report(server, "start")
        asyncio.run(load(url, server, args))
    finally:
        server.terminate()
        server.wait(60)
        os.unlink(log.name)


if __name__ == "__main__":
    main()
