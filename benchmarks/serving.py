"""Online serving benchmark, in the manner of vLLM's: streamed requests against a running server.

Requests arrive as a Poisson process at --request-rate per second (or all at once with the default, inf), with
random or fixed prompt and output lengths. Reports request and token throughput, time to first token (TTFT), time
per output token after the first (TPOT), inter-token latency between streamed chunks (ITL) and end-to-end
latency: mean, median and chosen percentiles; failures are counted. Prints a table and writes JSON.

    nanovllm serve MODEL --port 8000 &
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8 \\
        --input-len 512 --output-len 128 --random-range-ratio 0.5 --result-file results/serving.json

Prompts are random token ids drawn from the server's own tokenization of some English text (/tokenize), so
their lengths are exact; outputs use ``ignore_eos`` so they run to --output-len. A model without tokenizer
(say ``nanovllm serve FOLDER --load-format dummy`` on a folder with only config.json) answers /tokenize with 400:
then prompts are token ids drawn uniformly from --random-token-range [LOW, HIGH), which must lie inside the
model's vocabulary (completions endpoint only: chat needs a tokenizer).

Requests ask for vLLM's ``return_token_ids``, so tokens are counted from each chunk's ``token_ids`` (text may be
empty, and always is without a tokenizer): TTFT runs to the first chunk with a token, ITL between chunks with
tokens. A server that sends no ``token_ids`` is timed by the chunks with text instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime

import httpx

FILLER = ("The engine keeps keys and values in fixed-size blocks of one pool, and every step the scheduler "
          "picks which requests run and how many tokens each computes. Finished requests leave and waiting "
          "ones join at once; long prompts are prefilled in chunks so they cannot stall everyone else. ") * 4


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # seconds to the first streamed token
    latency: float = 0.0  # seconds to the end of the stream
    itl: list[float] = field(default_factory=list)  # seconds between streamed chunks with tokens
    error: str = ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                        help="/v1/completions with token-id prompts, or /v1/chat/completions with text")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, Poisson arrivals (default: inf, all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (mean with a range ratio)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens (mean with a range ratio)")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths uniform in [len*(1-r), len*(1+r)]; 0 means fixed lengths")
    parser.add_argument("--random-token-range", type=int, nargs=2, default=[100, 10000], metavar=("LOW", "HIGH"),
                        help="for a model without tokenizer: prompt token ids uniform in [LOW, HIGH), which must "
                             "be inside the model's vocabulary (default: 100 10000)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--percentiles", default="99", help="comma-separated percentiles to report besides "
                        "the median (default: 99)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--result-file", default=None, help="write the results here as JSON")
    args = parser.parse_args(argv)
    if not 0 <= args.random_range_ratio < 1:
        parser.error("--random-range-ratio must be in [0, 1)")
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        parser.error("--num-prompts, --input-len and --output-len must be positive")
    if not 0 <= args.random_token_range[0] < args.random_token_range[1]:
        parser.error("--random-token-range needs 0 <= LOW < HIGH")
    return args


def lengths(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(n)]


async def token_pool(client: httpx.AsyncClient) -> list[int] | None:
    """The server's token ids of FILLER; None when the model has no tokenizer (/tokenize answers 400 saying so)."""
    response = await client.post("/tokenize", json={"prompt": FILLER, "add_special_tokens": False})
    if response.status_code == 400 and "no tokenizer" in response.text:
        return None
    response.raise_for_status()
    return response.json()["tokens"]


async def make_prompts(client: httpx.AsyncClient, args, rng: random.Random,
                       pool: list[int] | None) -> list[tuple[object, int, int]]:
    """(prompt, prompt length, output length) of each request; without a pool, ids from --random-token-range."""
    input_lens = lengths(rng, args.input_len, args.random_range_ratio, args.num_prompts)
    output_lens = lengths(rng, args.output_len, args.random_range_ratio, args.num_prompts)
    low, high = args.random_token_range
    prompts = []
    for n, m in zip(input_lens, output_lens, strict=True):
        ids = rng.choices(pool, k=n) if pool is not None else [rng.randrange(low, high) for _ in range(n)]
        if args.endpoint == "chat":
            text = (await client.post("/detokenize", json={"tokens": ids})).json()["prompt"]
            prompts.append((text, n, m))
        else:
            prompts.append((ids, n, m))
    return prompts


def payload(args, model: str, prompt, output_len: int) -> tuple[str, dict]:
    body = {"model": model, "max_tokens": output_len, "temperature": args.temperature, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    if args.endpoint == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


async def send(client: httpx.AsyncClient, path: str, body: dict, prompt_len: int) -> RequestResult:
    result = RequestResult(prompt_len=prompt_len)
    start = last = time.perf_counter()
    tokens = 0  # streamed so far
    with_ids = False  # whether the server sends token_ids
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    result.ok = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk["error"]))
                    return result
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                    result.prompt_len = chunk["usage"]["prompt_tokens"]
                for choice in chunk.get("choices", []):
                    if "token_ids" in choice:
                        with_ids = True
                        new = len(choice["token_ids"])
                    else:  # a server without return_token_ids: one token per chunk with text
                        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                        new = 1 if text else 0
                    if new:
                        now = time.perf_counter()
                        if tokens == 0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        tokens += new
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    if not result.ok:
        result.error = "the stream ended without [DONE]"
    elif tokens == 0:
        result.ok = False
        result.error = "no streamed chunk carried a token: TTFT and ITL cannot be measured"
    elif not result.output_len:
        result.output_len = tokens  # a server without usage
    elif with_ids and tokens != result.output_len:
        result.ok = False
        result.error = f"the stream carried {tokens} token ids, but usage says {result.output_len} tokens"
    return result


async def run(args) -> dict:
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=args.timeout,
                                 limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).raise_for_status().json()["data"][0]["id"]
        pool = await token_pool(client)
        if pool is None and args.endpoint == "chat":
            raise RuntimeError("the model has no tokenizer, so chat prompts cannot be built: use --endpoint "
                               "completions (random token ids from --random-token-range)")
        prompts = await make_prompts(client, args, rng, pool)

        # one request first: a server that cannot answer fails fast, not num_prompts times
        path, body = payload(args, model, prompts[0][0], min(prompts[0][2], 4))
        probe = await send(client, path, body, prompts[0][1])
        if not probe.ok:
            raise RuntimeError(f"the test request failed: {probe.error}")

        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(prompt, prompt_len: int, output_len: int) -> RequestResult:
            path, body = payload(args, model, prompt, output_len)
            if semaphore is None:
                return await send(client, path, body, prompt_len)
            async with semaphore:
                return await send(client, path, body, prompt_len)

        start = time.perf_counter()
        tasks = []
        for prompt, prompt_len, output_len in prompts:
            tasks.append(asyncio.ensure_future(one(prompt, prompt_len, output_len)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(args, model, results, duration, random_ids=pool is None)


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict:
    ms = sorted(v * 1000 for v in values_s) or [0.0]
    out = {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms)}
    for p in percentiles:
        rank = min(len(ms) - 1, max(0, round(p / 100 * (len(ms) - 1))))
        out[f"p{p:g}_{name}_ms"] = ms[rank]
    return out


def summarize(args, model: str, results: list[RequestResult], duration: float, random_ids: bool = False) -> dict:
    ok = [r for r in results if r.ok]
    percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    summary = {
        "date": datetime.now().isoformat(timespec="seconds"), "base_url": args.base_url, "model": model,
        "endpoint": args.endpoint, "num_prompts": args.num_prompts,
        "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        "max_concurrency": args.max_concurrency, "input_len": args.input_len, "output_len": args.output_len,
        "random_range_ratio": args.random_range_ratio,
        # where the prompt ids came from: the server's tokenizer, or --random-token-range (no tokenizer)
        "prompt_token_range": list(args.random_token_range) if random_ids else None,
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        **_stats("ttft", [r.ttft for r in ok], percentiles),
        **_stats("tpot", tpots, percentiles),
        **_stats("itl", [t for r in ok for t in r.itl], percentiles),
        **_stats("e2el", [r.latency for r in ok], percentiles),
        "errors": sorted({r.error for r in results if not r.ok}),
    }
    return summary


def print_table(s: dict, percentiles: list[str]) -> None:
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", f"{s['duration']:.2f}"), ("Total input tokens", s["total_input_tokens"]),
            ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    print(f"{' Serving Benchmark Result ':=^56}")
    for name, value in rows:
        print(f"{name:<40}{value:>16}")
    for key, title in [("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")]:
        print(f"{' ' + title + ' ':-^56}")
        print(f"{'Mean ' + key.upper() + ' (ms)':<40}{s[f'mean_{key}_ms']:>16.2f}")
        print(f"{'Median ' + key.upper() + ' (ms)':<40}{s[f'median_{key}_ms']:>16.2f}")
        for p in percentiles:
            print(f"{'P' + p + ' ' + key.upper() + ' (ms)':<40}{s[f'p{float(p):g}_{key}_ms']:>16.2f}")
    print("=" * 56)
    for error in s["errors"]:
        print(f"error: {error}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        summary = asyncio.run(run(args))
    except (httpx.HTTPError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print_table(summary, [p.strip() for p in args.percentiles.split(",") if p.strip()])
    if args.result_file:
        os.makedirs(os.path.dirname(os.path.abspath(args.result_file)), exist_ok=True)
        with open(args.result_file, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
