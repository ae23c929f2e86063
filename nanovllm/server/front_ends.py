"""``nanovllm serve --api-server-count N``: N front-end processes on one port in front of one engine core.

```
                      ┌── front end 0 (uvicorn, tokenizer, detokenizer) ── pipe 0 ──┐
  clients ── port ────┤        ...   (each its own SO_REUSEPORT socket)             ├── engine core process
                      └── front end N-1 ─────────────────────────────────── pipe N-1 ┘
  this process: starts the core, then the front ends; forwards SIGTERM; exits with their status
```

When one front end's CPU is the limit (HTTP, JSON and detokenization of every stream run in one interpreter),
more of them share the streams: each binds the port with SO_REUSEPORT, so the kernel spreads new connections
over them, and each talks to the core over a pipe of its own. The core sends a request's outputs to the front end
that added it.

Metrics: every front end records its own requests (TTFT, ITL, tokens, finishes) into prometheus-client's
multiprocess files in one folder, and /metrics on any of them answers the sum over all (gauges: the most recent
value of any). The core's counters (preemptions, prefix-cache lookups) go to one front end only, so they are not
counted N times; its gauges (running, waiting, KV usage) to every one.

Faults: if the core dies, every front end ends its streams with an error event and [DONE], answers 503, and exits
non-zero within seconds (as a single front end does); this process then exits non-zero too. A front end that
exits on its own (say its port was taken) stops the others, and this process exits non-zero. SIGTERM (or SIGINT)
drains every front end; the core stops once each has said stop.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile

logger = logging.getLogger(__name__)

FRONT_END_HEADER = b"x-nanovllm-front-end"  # which front end answered (only with more than one)
EXIT_FAILED = 1
STOP_TIMEOUT_S = 30.0
HELD_SIGNALS = {signal.SIGTERM, signal.SIGINT}  # by a starting front end until its server handles them


def run_front_ends(args: argparse.Namespace) -> int:
    """Start the engine core and ``args.api_server_count`` front ends; wait for them; the exit status."""
    from multiprocessing.connection import wait

    from nanovllm.engine.core_client import join_engine_core, start_engine_core
    from nanovllm.engine_args import engine_kwargs

    count = args.api_server_count
    metrics_dir = tempfile.mkdtemp(prefix="nanovllm-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by the front ends (started below) at import
    front_ends: list[multiprocessing.Process] = []
    stopping = False

    def handle_exit(sig: int, frame) -> None:
        nonlocal stopping
        stopping = True
        for proc in front_ends:  # (SIGTERM, also for a Ctrl-C that reached them too: it only drains once more)
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    try:
        core, conns, info = start_engine_core(engine_kwargs(args), count)
        logger.info("%s", info.kv_cache)
        logger.info("serving %d front ends on http://%s:%d", count, args.host, args.port)
        context = multiprocessing.get_context("spawn")
        signal.signal(signal.SIGTERM, handle_exit)
        signal.signal(signal.SIGINT, handle_exit)
        for index, conn in enumerate(conns):
            proc = context.Process(target=_front_end, args=(args, index, conn, info), name=f"nanovllm-api-{index}")
            # A SIGTERM forwarded while a front end still starts (another may already serve) must drain it, not
            # kill it: it starts with the signals blocked (a mask survives exec) until its server handles them
            signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
            try:
                proc.start()
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)
            conn.close()  # the front end has its own copy
            front_ends.append(proc)
        status = 0
        running = list(front_ends)
        while running:
            ready = wait([p.sentinel for p in running])
            for proc in [p for p in running if p.sentinel in ready]:
                proc.join()
                running.remove(proc)
                if proc.exitcode != 0:
                    status = EXIT_FAILED
                if (proc.exitcode != 0 or not stopping) and core.is_alive():
                    # a front end left on its own (the core's death ends them all by itself): stop the others
                    logger.error("front end %s exited with %s: stopping the others", proc.name, proc.exitcode)
                    status = EXIT_FAILED
                    handle_exit(signal.SIGTERM, None)
        join_engine_core(core, STOP_TIMEOUT_S)  # it stops once every front end said stop (or went away)
        if core.exitcode != 0:
            status = EXIT_FAILED
        return status
    finally:
        for proc in front_ends:
            if proc.is_alive():
                proc.kill()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _front_end(args: argparse.Namespace, index: int, conn, info) -> None:
    """Process target: one front end on its own SO_REUSEPORT socket of --host/--port, through ``conn`` to the core."""
    from nanovllm.server.serve import build_app_from_args, serve_app

    logging.basicConfig(level=args.log_level.upper(), format=f"%(levelname)s [front end {index}] %(name)s: "
                        "%(message)s")
    family, kind, proto, _, address = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError as e:
        logger.error("cannot listen on %s:%s: %s", args.host, args.port, e)
        sys.exit(EXIT_FAILED)
    app = build_app_from_args(args, core=(conn, info))
    app.add_middleware(FrontEndHeader, value=str(index).encode())
    _release_held_signals_at_startup(app)
    sys.exit(serve_app(app, args, sockets=[sock]))


def _release_held_signals_at_startup(app) -> None:
    """Unblock HELD_SIGNALS when the app starts: uvicorn installs its handlers before it starts the app, so a
    signal held since the process began is then handled as a drain."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app_):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)
        async with inner(app_) as state:
            yield state

    app.router.lifespan_context = lifespan


class FrontEndHeader:
    """Adds ``x-nanovllm-front-end: <index>`` to every response (which process answered: for logs and tests)."""

    def __init__(self, app, value: bytes):
        self.app = app
        self.value = value

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (FRONT_END_HEADER, self.value)]}
            await send(message)

        return await self.app(scope, receive, send_with_header)
