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

It can also start the server itself (--launch MODEL, with --server-args), run the same requests through the
offline engine in the same call for comparison (--offline), sweep several Poisson rates (--request-rates 8,16,32,64)
and plot p50/p99 TTFT and TPOT against the rate (--plot FILE.png, matplotlib), e.g. the CPU proxy (a small random
Qwen3: hidden 128, 2 layers, vocab 2048, written to a temporary folder)::

    python benchmarks/serving.py --cpu-proxy --num-prompts 128 --input-len 32 --output-len 128 --offline

Requests ask for vLLM's ``return_token_ids``, so tokens are counted from each chunk's ``token_ids`` (text may be
empty, and always is without a tokenizer): TTFT runs to the first chunk with a token, ITL between chunks with
tokens. A server that sends no ``token_ids`` is timed by the chunks with text instead.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
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
    parser.add_argument("--warmup-requests", type=int, default=8,
                        help="N requests of the same lengths (other random prompts), sent together and not counted, "
                             "before the timed run (and, with --offline, before the offline call: both sides warm up "
                             "alike)")
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
    parser.add_argument("--client", choices=["raw", "httpx"], default=None,
                        help="how streams are read: raw (asyncio + httptools, the lean one) or httpx (default: raw "
                             "for an http:// server when httptools is installed)")
    parser.add_argument("--event-loop", choices=["uvloop", "asyncio"], default=None,
                        help="the client's event loop (default: uvloop where installed)")
    parser.add_argument("--result-file", default=None, help="write the results here as JSON")
    parser.add_argument("--request-rates", default=None,
                        help="comma-separated Poisson rates to sweep, one run each (instead of --request-rate)")
    parser.add_argument("--plot", default=None, help="with --request-rates: write a PNG of p50/p99 TTFT and TPOT "
                        "against the rate here (needs matplotlib)")
    parser.add_argument("--launch", default=None, metavar="MODEL",
                        help="start `nanovllm serve MODEL` on a free port for the run (and stop it after)")
    parser.add_argument("--server-args", default="", help="with --launch: more flags for the server, one string")
    parser.add_argument("--cpu-proxy", action="store_true",
                        help="--launch a small random Qwen3 (hidden 128, 2 layers, vocab 2048, dummy weights)")
    parser.add_argument("--offline", action="store_true",
                        help="with --launch: then run the same requests through the offline engine (same engine "
                             "flags) in this process, and report the streamed/offline output throughput ratio")
    parser.add_argument("--plot-from", default=None, metavar="JSON",
                        help="only draw --plot from a sweep's result file (e.g. written on a machine without "
                             "matplotlib)")
    parser.add_argument("--offline-threads", type=int, default=None,
                        help="with --offline on the CPU: torch threads of the offline engine (default: torch's own; "
                             "the served core takes one less than that, leaving a core to the front end)")
    args = parser.parse_args(argv)
    if args.cpu_proxy:
        args.launch = args.launch or write_cpu_proxy()
        args.server_args = f"--load-format dummy {args.server_args}"
        if "--num-kvcache-blocks" not in args.server_args:  # the default pool (16,384 tokens) would preempt
            per_request = int((args.input_len + args.output_len) * (1 + args.random_range_ratio)) + 16
            args.server_args += f" --num-kvcache-blocks {args.num_prompts * (per_request // 16 + 1)}"
        if args.random_token_range == [100, 10000]:
            args.random_token_range = [100, 2000]
    if args.client is None:
        args.client = "raw" if args.base_url.startswith("http://") and _have_httptools() else "httpx"
    if args.offline and not args.launch:
        parser.error("--offline needs --launch (the engine flags of the server)")
    if not 0 <= args.random_range_ratio < 1:
        parser.error("--random-range-ratio must be in [0, 1)")
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        parser.error("--num-prompts, --input-len and --output-len must be positive")
    if args.warmup_requests < 0:
        parser.error(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    if not 0 <= args.random_token_range[0] < args.random_token_range[1]:
        parser.error("--random-token-range needs 0 <= LOW < HIGH")
    return args


def _have_httptools() -> bool:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return False
    return True


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


_ERROR = re.compile(rb'\{\s*"error"\s*:')
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_TOKEN_IDS = re.compile(rb'"token_ids"\s*:\s*\[([^\]]*)\]')  # not "prompt_token_ids": its quote comes first


class StreamReader:
    """Reads one SSE stream's events as they come, cheaply: the benchmark's client shares the machine with the
    server, so it parses no JSON per chunk. Tokens are counted from each choice's ``"token_ids":[...]`` (a JSON
    list of ints: its commas plus one), exactly, however many tokens a chunk carries; only an error event, the
    usage chunk and a server that sends no token_ids are parsed as JSON."""

    def __init__(self, result: RequestResult, start: float):
        self.result = result
        self.start = self.last = start
        self.tokens = 0  # streamed so far
        self.with_ids = False  # whether the server sends token_ids
        self.done = False  # [DONE] came, or an error event
        self.pending = b""

    def feed(self, data: bytes) -> None:
        """Take in bytes of the body as they arrive."""
        events = (self.pending + data).split(b"\n\n")
        self.pending = events.pop()
        now = None
        for event in events:
            if self.done or not event.startswith(b"data: "):
                continue
            payload = event[6:]
            if payload == b"[DONE]":
                self.result.ok = self.done = True
                continue
            new = self._count(payload)
            if new:
                now = now or time.perf_counter()
                if self.tokens == 0:
                    self.result.ttft = now - self.start
                else:
                    self.result.itl.append(now - self.last)
                self.last = now
                self.tokens += new

    def _count(self, payload: bytes) -> int:
        if _ERROR.match(payload):
            error = json.loads(payload)["error"]
            self.result.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)
            self.done = True
            return 0
        if _USAGE.search(payload):  # (a text's own quotes are escaped, so it cannot look like this)
            usage = json.loads(payload)["usage"]
            self.result.output_len, self.result.prompt_len = usage["completion_tokens"], usage["prompt_tokens"]
        new = 0
        for ids in _TOKEN_IDS.findall(payload):  # every choice of the chunk
            self.with_ids = True
            new += ids.count(b",") + 1 if ids.strip() else 0
        if not self.with_ids:  # a server without return_token_ids: one token per chunk with text
            for choice in json.loads(payload).get("choices", []):
                text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                new += 1 if text else 0
        return new

    def finish(self) -> RequestResult:
        result = self.result
        result.latency = time.perf_counter() - self.start
        if result.error:
            result.ok = False
        elif not result.ok:
            result.error = "the stream ended without [DONE]"
        elif self.tokens == 0:
            result.ok = False
            result.error = "no streamed chunk carried a token: TTFT and ITL cannot be measured"
        elif not result.output_len:
            result.output_len = self.tokens  # a server without usage
        elif self.with_ids and self.tokens != result.output_len:
            result.ok = False
            result.error = f"the stream carried {self.tokens} token ids, but usage says {result.output_len} tokens"
        return result


async def send(client: httpx.AsyncClient, path: str, body: dict, prompt_len: int) -> RequestResult:
    """One streamed request; through RawClient when ``client`` is one, else httpx."""
    if isinstance(client, RawClient):
        return await client.send(path, body, prompt_len)
    result = RequestResult(prompt_len=prompt_len)
    reader = StreamReader(result, time.perf_counter())
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for data in response.aiter_raw():
                reader.feed(data)
                if reader.done:
                    break
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    return reader.finish()


class RawClient:
    """Streamed POSTs over plain asyncio connections, the response parsed by httptools (C): several times less
    CPU per chunk than httpx (measured in docs/benchmarks.md), which matters when the client shares the server's
    cores. One connection per request (``Connection: close``); http:// only."""

    def __init__(self, base_url: str, headers: dict[str, str], timeout: float):
        import httptools  # the server's own HTTP parser (the serve extra)
        self.httptools = httptools
        url = httpx.URL(base_url)
        self.host, self.port = url.host, url.port or 80
        self.prefix = url.raw_path.decode().rstrip("/")
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.timeout = timeout

    async def send(self, path: str, body: dict, prompt_len: int) -> RequestResult:
        result = RequestResult(prompt_len=prompt_len)
        data = json.dumps(body).encode()
        head = (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: "
                f"application/json\r\nAccept: text/event-stream\r\nConnection: close\r\n{self.headers}"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        reader = StreamReader(result, time.perf_counter())
        parsed = _ParsedResponse(reader)
        parser = parsed.parser = self.httptools.HttpResponseParser(parsed)
        try:
            async with asyncio.timeout(self.timeout):
                stream_in, stream_out = await asyncio.open_connection(self.host, self.port)
                try:
                    stream_out.write(head + data)
                    while not parsed.complete and not reader.done:
                        chunk = await stream_in.read(1 << 16)
                        if not chunk:
                            break
                        parser.feed_data(chunk)
                finally:
                    stream_out.close()
        except (OSError, TimeoutError, self.httptools.HttpParserError, json.JSONDecodeError, ValueError) as e:
            result.error = f"{type(e).__name__}: {e}"
            return result
        if parsed.status != 200:
            result.error = f"HTTP {parsed.status}: {bytes(parsed.error_body).decode(errors='replace')[:200]}"
            return result
        return reader.finish()


class _ParsedResponse:
    """httptools' callbacks: the body goes to the StreamReader once the status says 200."""

    def __init__(self, reader: StreamReader):
        self.reader = reader
        self.parser = None  # the HttpResponseParser these callbacks belong to
        self.status: int | None = None
        self.complete = False
        self.error_body = bytearray()

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.status == 200:
            self.reader.feed(body)
        else:
            self.error_body += body

    def on_message_complete(self) -> None:
        self.complete = True


def write_cpu_proxy() -> str:
    """A config.json of a small random Qwen3 (weights come from --load-format dummy) in a temporary folder."""
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "model_configs", "qwen3-0.6b", "config.json")) as f:
        config = json.load(f)
    config.update(hidden_size=128, intermediate_size=384, num_hidden_layers=2, max_window_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=2048, bos_token_id=1,
                  eos_token_id=2, max_position_embeddings=4096, torch_dtype="float32")
    folder = tempfile.mkdtemp(prefix="nanovllm-cpu-proxy-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


class LaunchedServer:
    """`python -m nanovllm.server.serve MODEL` on a free port, until stopped."""

    def __init__(self, model: str, server_args: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "nanovllm.server.serve", model, "--port", str(self.port),
                                      "--no-access-log", "--log-level", "warning", *shlex.split(server_args)],
                                     env=env)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time so far of the front end (the server process) and of its children (the engine core), from
        /proc (Linux): a front end near 1 CPU-second per second is saturated (a case for more front ends)."""
        def seconds(pid: int) -> float:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        try:
            children = [int(c) for c in open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read().split()]
            return {"front_end": seconds(self.proc.pid), "children": sum(seconds(c) for c in children)}
        except (OSError, ValueError):
            return {}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_offline(args, prompts: list[tuple[object, int, int]]) -> dict:
    """The same requests (token-id prompts, output lengths) through ``LLM.generate`` with the server's engine flags,
    after the same warm-up as the server's (--warmup-requests): output tok/s of the whole call, as benchmarks/throughput.py counts it."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from nanovllm import LLM, SamplingParams
    from nanovllm.engine_args import engine_kwargs
    from nanovllm.server.serve import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    served = parser.parse_args([args.launch, *shlex.split(args.server_args)])
    if args.offline_threads:
        import torch
        torch.set_num_threads(args.offline_threads)
    llm = LLM(**engine_kwargs(served))
    try:
        def requests(prompts):
            ids = [p if isinstance(p, list) else llm.tokenize_prompt(p)[1] for p, _, _ in prompts]
            return ids, [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=m)
                         for _, _, m in prompts]

        warmup = getattr(args, "warmup_prompts", [])
        if warmup:  # the same warm-up as the server had
            llm.generate(*requests(warmup), use_tqdm=False)
        ids, params = requests(prompts)
        start = time.perf_counter()
        outputs = llm.generate(ids, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        llm.close()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"offline_seconds": seconds, "offline_output_tokens": tokens, "offline_output_throughput": tokens / seconds}


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
        streamer = RawClient(args.base_url, headers, args.timeout) if args.client == "raw" else client
        probe = await send(streamer, path, body, prompts[0][1])
        if not probe.ok:
            raise RuntimeError(f"the test request failed: {probe.error}")
        # then a warm-up, as the offline engine gets: a server's first batch pays for what it does once. Its prompts
        # are drawn apart from the timed ones, so none of those meets a prefix the warm-up cached.
        warmup_args = argparse.Namespace(**{**vars(args), "num_prompts": args.warmup_requests})
        args.warmup_prompts = await make_prompts(client, warmup_args, random.Random(f"warm-up {args.seed}"), pool)
        warmup = await asyncio.gather(*(send(streamer, *payload(args, model, prompt, output_len), prompt_len)
                                        for prompt, prompt_len, output_len in args.warmup_prompts))
        if not all(r.ok for r in warmup):
            raise RuntimeError(f"a warm-up request failed: {next(r.error for r in warmup if not r.ok)}")

        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(prompt, prompt_len: int, output_len: int) -> RequestResult:
            path, body = payload(args, model, prompt, output_len)
            if semaphore is None:
                return await send(streamer, path, body, prompt_len)
            async with semaphore:
                return await send(streamer, path, body, prompt_len)

        args.prompts = prompts  # for --offline
        start, cpu_start = time.perf_counter(), time.process_time()
        tasks = []
        for prompt, prompt_len, output_len in prompts:
            tasks.append(asyncio.ensure_future(one(prompt, prompt_len, output_len)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        client_cpu = time.process_time() - cpu_start
    summary = summarize(args, model, results, duration, random_ids=pool is None)
    summary.update(client=args.client, client_cpu_per_s=client_cpu / duration)  # this process's share of the cores
    return summary


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
        "chunks_with_tokens": sum(len(r.itl) + 1 for r in ok),  # fewer than tokens: chunks carried several
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
            ("Streamed chunks with tokens", s.get("chunks_with_tokens", "-")),
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


def plot(runs: list[dict], path: str) -> None:
    """p50 and p99 TTFT and TPOT against the request rate, two panels, as PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["request_rate"] for r in runs]
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in [(axes[0], "ttft", "Time to first token"), (axes[1], "tpot", "Time per output token")]:
        ax.plot(rates, [r[f"median_{key}_ms"] for r in runs], "o-", label="p50")
        ax.plot(rates, [r[f"p99_{key}_ms"] for r in runs], "s--", label="p99")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    name = os.path.basename(str(runs[0]["model"]).rstrip("/"))
    figure.suptitle(f"{name}: {runs[0]['num_prompts']} requests, {runs[0]['input_len']} in / "
                    f"{runs[0]['output_len']} out (+-{runs[0]['random_range_ratio']:.0%})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run_client(args) -> dict:
    """One timed run of the client, on uvloop's event loop where installed (a third less of the client's CPU
    per streamed chunk than asyncio's own loop, docs/benchmarks.md)."""
    if args.event_loop is None:
        args.event_loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    if args.event_loop == "asyncio":
        return asyncio.run(run(args))
    import uvloop
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(run(args))


def run_all(args) -> dict:
    """One run, or a sweep over --request-rates; with --launch around a server of our own, then --offline."""
    server = LaunchedServer(args.launch, args.server_args) if args.launch else None
    if server is not None:
        args.base_url = server.url
    try:
        if args.request_rates:
            runs = []
            for rate in [float(r) for r in args.request_rates.split(",")]:
                args.request_rate = rate
                runs.append(run_client(args))
                print_table(runs[-1], _percentiles(args))
            result = {"runs": runs}
        else:
            before = server.cpu_seconds() if server is not None else {}
            result = run_client(args)
            after = server.cpu_seconds() if server is not None else {}
            for name in set(before) & set(after):  # CPU-seconds per second of the run, per process
                result[f"{name}_cpu_per_s"] = (after[name] - before[name]) / result["duration"]
            print_table(result, _percentiles(args))
            if "front_end_cpu_per_s" in result:
                print(f"CPU per second of the run: front end {result['front_end_cpu_per_s']:.2f}, engine core and "
                      f"other children {result.get('children_cpu_per_s', 0):.2f}, this client "
                      f"({result['client']}) {result['client_cpu_per_s']:.2f}")
    finally:
        if server is not None:
            server.stop()
    result["event_loop"] = args.event_loop
    if args.offline:
        offline = run_offline(args, args.prompts)
        streamed = result["runs"][-1] if "runs" in result else result
        result.update(offline, ratio_to_offline=streamed["output_throughput"] / offline["offline_output_throughput"])
        print(f"offline: {offline['offline_output_throughput']:.0f} out tok/s; streamed / offline = "
              f"{result['ratio_to_offline']:.3f}")
    return result


def _percentiles(args) -> list[str]:
    return [p.strip() for p in args.percentiles.split(",") if p.strip()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_from:
        with open(args.plot_from) as f:
            plot(json.load(f)["runs"], args.plot or os.path.splitext(args.plot_from)[0] + ".png")
        return 0
    try:
        result = run_all(args)
    except (httpx.HTTPError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.result_file:
        os.makedirs(os.path.dirname(os.path.abspath(args.result_file)), exist_ok=True)
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot and "runs" in result:
        plot(result["runs"], args.plot)
    runs = result.get("runs", [result])
    return 0 if all(r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
