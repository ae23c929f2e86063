"""`nanovllm serve [MODEL]`: the OpenAI-compatible server's flags, and running it under uvicorn.

Every engine argument (a field of EngineConfig) is also a flag: ``max_num_seqs`` is ``--max-num-seqs``.
Run directly with ``python -m nanovllm.server.serve MODEL --port 8000``.

The engine runs in a process of its own (``nanovllm.engine.core``); this process serves HTTP, tokenizes and
detokenizes. SIGTERM (or SIGINT) drains: new requests are refused at once (503, and /health says 503), requests
in flight run to their end for up to --timeout-graceful-shutdown seconds, then the engine stops and the process
exits 0. If the engine process dies, open streams end with an error event, /health and new requests get 503, and
the server exits with status 1 within seconds. ``--api-server-count N`` runs N such front ends on the port in front
of one engine process (server/front_ends.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from nanovllm.engine_args import add_engine_args, engine_kwargs
from nanovllm.server.defaults import (  # noqa: F401 (API_KEY_ENV is part of this module's interface)
    API_KEY_ENV,
    DEFAULT_MAX_N,
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MODEL_NAME,
)

# After the engine process died: how long /health keeps answering 503 (for load balancers) before the exit.
DEAD_ENGINE_EXIT_DELAY_S = 3.0
EXIT_ENGINE_DIED = 1
# On the CPU the engine core computes the model and is the server's bottleneck; a front end that competes with it
# for a core (with the clients' processes on the same machine) slows every step. At this niceness it still runs
# whenever a core is free, and when it falls behind the core's steps fold into fewer, larger messages.
CPU_FRONT_END_NICENESS = 10



class _OneModel(argparse.Action):
    """MODEL as the positional or as --model (as vLLM takes it): either, or both when they agree."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        if current is not None and current != values:
            parser.error(f"two models given, {current!r} and {values!r}: give one, as MODEL or as --model")
        setattr(namespace, self.dest, values)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    model_help = "a Hugging Face model folder or a .gguf file (default: the embedded SmolLM2-135M-Instruct)"
    # SUPPRESS: an absent positional leaves what --model set
    parser.add_argument("model", nargs="?", default=argparse.SUPPRESS, action=_OneModel, help=model_help)
    parser.add_argument("--model", dest="model", default=None, action=_OneModel, metavar="MODEL",
                        help="the same as the positional MODEL")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="name(s) clients use in 'model' (default: the model path as given)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help=f"require 'Authorization: Bearer <key>' on every endpoint but /health and /metrics "
                             f"(default: ${API_KEY_ENV})")
    parser.add_argument("--max-queued-requests", type=int, default=None,
                        help="requests allowed to wait beyond --max-num-seqs running ones before new ones get "
                             "429 with Retry-After (default: no limit)")
    parser.add_argument("--max-request-body-bytes", type=int, default=8 << 20,
                        help="larger request bodies get 413 (default: 8 MiB; 0 for no limit)")
    parser.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                        help=f"largest n (samples per prompt) a request may ask for (default: {DEFAULT_MAX_N}, "
                             "the OpenAI API's own cap)")
    parser.add_argument("--max-prompts-per-request", type=int, default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
                        help="most prompts in one /v1/completions request (default: "
                             f"{DEFAULT_MAX_PROMPTS_PER_REQUEST})")
    parser.add_argument("--timeout-graceful-shutdown", type=float, default=30.0,
                        help="on SIGTERM/SIGINT, seconds to let in-flight requests finish (default: 30)")
    parser.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                        help="how tool_choice 'auto' reads the model's tool calls: hermes (Qwen2.5/Qwen3's "
                             "<tool_call>) or llama3_json (Llama 3.x's JSON)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="let requests use tool_choice 'auto' (needs --tool-call-parser)")
    parser.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                        help="split the model's <think>...</think> into reasoning_content")
    parser.add_argument("--api-server-count", type=int, default=1,
                        help="front-end processes (HTTP, tokenizer, detokenizer) sharing the port in front of one "
                             "engine core, for when one front end's CPU is the limit")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="log level (default: info)")
    parser.add_argument("--no-access-log", dest="access_log", action="store_false",
                        help="do not log each HTTP request")
    add_engine_args(parser, include_model=False)


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to a CLI's subparsers; its handler is ``run_server(args)``."""
    from nanovllm.engine_args import DefaultsHelpFormatter

    parser = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                                   description="Serve a model over an OpenAI-compatible HTTP API.",
                                   formatter_class=DefaultsHelpFormatter)
    add_serve_arguments(parser)
    parser.set_defaults(func=run_server)
    return parser


def _check_serve_args(args: argparse.Namespace) -> None:
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be non-negative, got {args.max_queued_requests}.")
    for flag in ("max_n", "max_prompts_per_request", "api_server_count"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}.")
    from nanovllm.server.tools import check_tool_call_parser
    check_tool_call_parser(args.tool_call_parser, args.enable_auto_tool_choice)  # before the model loads


def build_app_from_args(args: argparse.Namespace, core=None):
    """Load the engine (or attach to ``core``, a front end's share of one started for several) and build the app
    (what ``run_server`` serves)."""
    from nanovllm.engine.core_client import AsyncEngineClient
    from nanovllm.server.app import build_app

    _check_serve_args(args)
    if core is None:
        kwargs = engine_kwargs(args)  # the positional MODEL is among them, as "model"
        llm = AsyncEngineClient.from_engine_args(max_queued_requests=args.max_queued_requests, **kwargs)
    else:
        llm = AsyncEngineClient(None, max_queued_requests=args.max_queued_requests, core=core)
    names = args.served_model_name or [args.model if args.model is not None else DEFAULT_MODEL_NAME]
    return build_app(llm, served_model_names=names, api_key=args.api_key,
                     max_request_body_bytes=args.max_request_body_bytes or None, max_n=args.max_n,
                     max_prompts_per_request=args.max_prompts_per_request, tool_call_parser=args.tool_call_parser,
                     enable_auto_tool_choice=args.enable_auto_tool_choice, reasoning_parser=args.reasoning_parser)


def run_server(args: argparse.Namespace) -> int:
    """Load the model, then serve until SIGINT/SIGTERM (which drain in-flight requests first)."""
    try:
        import uvicorn  # noqa: F401
    except ImportError:
        print("error: the server needs FastAPI, uvicorn and prometheus-client: pip install 'nanovllm[serve]'",
              file=sys.stderr)
        return 1

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.api_server_count > 1:
        from nanovllm.server.front_ends import run_front_ends
        _check_serve_args(args)  # before the model loads
        return run_front_ends(args)
    app = build_app_from_args(args)  # the engine core says what it loads (logged here) before it reads weights
    log = logging.getLogger(__name__)
    log.info("%s", app.state.server.llm.kv_cache_summary)
    log.info("serving %s on http://%s:%d", app.state.server.model_names, args.host, args.port)
    return serve_app(app, args)


def serve_app(app, args: argparse.Namespace, sockets=None) -> int:
    """Run ``app`` under uvicorn (on ``sockets`` if given, else --host/--port) until SIGINT/SIGTERM or the
    engine's death; the exit status."""
    import uvicorn

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.access_log, timeout_graceful_shutdown=args.timeout_graceful_shutdown)
    server = uvicorn.Server(config)
    llm = app.state.server.llm

    def handle_exit(sig: int, frame) -> None:
        # uvicorn's own handler also re-raises the signal once shut down, so a complete drain would still end
        # the process by the signal (exit status -15); a drain asked for by a signal is a clean exit here.
        llm.stop_admissions()
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True  # a second Ctrl-C: stop waiting for requests in flight
        else:
            server.should_exit = True

    server.handle_exit = handle_exit  # what uvicorn installs for SIGINT and SIGTERM

    def engine_died() -> None:  # from the client's output thread, once every open request has been failed
        def leave() -> None:
            server.should_exit = True
        threading.Timer(DEAD_ENGINE_EXIT_DELAY_S, leave).start()

    llm.on_dead.append(engine_died)
    if llm.device == "cpu":
        os.nice(CPU_FRONT_END_NICENESS)  # the core, already started, keeps its own
    try:
        server.run(sockets=sockets)
    finally:
        llm.shutdown()  # (the app's shutdown did it already, unless uvicorn failed to start)
    if llm.error is not None:
        logging.getLogger(__name__).error("exiting: %s", llm.error)
        return EXIT_ENGINE_DIED
    return 0


def main(argv: list[str] | None = None) -> int:
    from nanovllm.engine_args import DefaultsHelpFormatter

    parser = argparse.ArgumentParser(prog="nanovllm serve", description="Serve a model over an OpenAI-compatible "
                                     "HTTP API.", formatter_class=DefaultsHelpFormatter)
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_server(args)
    except (FileNotFoundError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
