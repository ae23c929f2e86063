"""The `serve` flags: server options, every engine argument, and the API key from the environment."""

from __future__ import annotations

import argparse

from nanovllm.engine_args import engine_kwargs
from nanovllm.server.serve import API_KEY_ENV, add_serve_arguments, add_serve_parser, run_server


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(argv)


def test_defaults(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = parse([])
    assert args.model is None and args.host == "127.0.0.1" and args.port == 8000
    assert args.api_key is None and args.max_queued_requests is None


def test_engine_arguments_are_flags():
    args = parse(["some/model", "--max-model-len", "512", "--max-num-seqs", "3", "--num-kvcache-blocks", "9",
                  "--kvcache-block-size", "32", "--dtype", "bfloat16", "--device", "cpu",
                  "--tensor-parallel-size", "2", "--no-enable-prefix-caching"])
    kwargs = engine_kwargs(args)
    assert kwargs["model"] == "some/model"
    assert (kwargs["max_model_len"], kwargs["max_num_seqs"], kwargs["num_kvcache_blocks"]) == (512, 3, 9)
    assert (kwargs["kvcache_block_size"], kwargs["dtype"], kwargs["device"]) == (32, "bfloat16", "cpu")
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["enable_prefix_caching"] is False
    # server options are not engine arguments
    assert not {"host", "port", "api_key", "served_model_name"} & set(kwargs)


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert parse([]).api_key == "from-env"
    assert parse(["--api-key", "from-flag"]).api_key == "from-flag"


def test_subcommand():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "m", "--port", "9000"])
    assert args.func is run_server and args.model == "m" and args.port == 9000


def test_the_start_says_what_it_loads_and_the_kv_pool_the_engine_process_got(chat_model):
    from tests.server.conftest import ENGINE_FLAGS, ServerProcess

    server = ServerProcess(chat_model, *ENGINE_FLAGS, "--log-level", "info")
    try:
        output = server.output()
    finally:
        assert server.stop() == 0
    assert f"Loading {chat_model} on cpu" in output, output
    assert "KV cache: " in output and "4,096 tokens (256 blocks of 16)" in output, output
