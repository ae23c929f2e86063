"""Many clients at once, and clients that leave: continuous batching across HTTP requests, and aborts."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import REPO_ROOT, metric_values, wait_for

openai = pytest.importorskip("openai")

PROMPTS = [f"Request number {i}: tell me about block {i % 5}." for i in range(32)]


def _idle(url: str) -> dict | None:
    m = metric_values(url)
    if m["nanovllm:num_requests_running"] == 0 and m["nanovllm:num_requests_waiting"] == 0 \
            and m["nanovllm:kv_cache_usage_perc"] == 0:
        return m
    return None


def test_32_concurrent_streams_all_complete(server, chat_model):
    from nanovllm import LLM, SamplingParams

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, int, float]:
        stream = await client.completions.create(model=chat_model, prompt=prompt, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, usage, first = "", None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first = first or time.monotonic()
                text += chunk.choices[0].text
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return text, usage, first

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    before = metric_values(server.url)
    results = asyncio.run(run_all())
    assert [usage for _, usage, _ in results] == [12] * 32

    # the same greedy texts as one offline batch
    llm = LLM(chat_model, kvcache_block_size=16, num_kvcache_blocks=256)
    try:
        expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)
    finally:
        llm.close()
    assert [text for text, _, _ in results] == [e.outputs[0].text for e in expected]

    after = wait_for(lambda: _idle(server.url))
    assert after, f"the server did not go idle: {metric_values(server.url)}"
    assert after["nanovllm:num_requests_running"] == 0 and after["nanovllm:kv_cache_usage_perc"] == 0
    finished = 'nanovllm:request_success_total{finished_reason="length"}'
    assert after[finished] - before[finished] == 32
    assert after["nanovllm:generation_tokens_total"] - before["nanovllm:generation_tokens_total"] == 32 * 12
    assert after["nanovllm:time_to_first_token_seconds_count"] - before["nanovllm:time_to_first_token_seconds_count"] == 32
    assert after["nanovllm:e2e_request_latency_seconds_count"] - before["nanovllm:e2e_request_latency_seconds_count"] == 32
    assert after["nanovllm:prefix_cache_queries_total"] > before["nanovllm:prefix_cache_queries_total"]


ABORTED = 'nanovllm:request_success_total{finished_reason="abort"}'


def test_client_that_disconnects_mid_stream_is_aborted(server, chat_model):
    before = metric_values(server.url)
    body = {"model": chat_model, "messages": [{"role": "user", "content": "Talk forever."}], "stream": True,
            "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["role"] == "assistant"
            wait_for(lambda: metric_values(server.url)["nanovllm:num_requests_running"] >= 1, timeout=5)
        # leaving the `with` closed the connection mid-stream

    after = wait_for(lambda: (m := metric_values(server.url))[ABORTED] > before[ABORTED] and _idle(server.url) and m,
                     timeout=10)
    assert after, f"the request was not aborted: {metric_values(server.url)}"
    assert after[ABORTED] - before[ABORTED] == 1
    # it stopped long before its 1000 tokens, and freed its blocks
    assert after["nanovllm:generation_tokens_total"] - before["nanovllm:generation_tokens_total"] < 900
    assert after["nanovllm:kv_cache_usage_perc"] == 0

    # the server goes on serving
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        result = client.completions.create(model=chat_model, prompt="Still there?", max_tokens=3)
    assert result.usage.completion_tokens == 3


def test_client_that_disconnects_while_waiting_for_a_whole_answer_is_aborted(server, chat_model):
    before = metric_values(server.url)
    body = json.dumps({"model": chat_model, "prompt": "Talk forever.", "max_tokens": 1000, "ignore_eos": True})
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request.encode())
        assert wait_for(lambda: metric_values(server.url)["nanovllm:num_requests_running"] >= 1, timeout=5)
    after = wait_for(lambda: (m := metric_values(server.url))[ABORTED] > before[ABORTED] and _idle(server.url) and m,
                     timeout=10)
    assert after, f"the request was not aborted: {metric_values(server.url)}"
    assert after["nanovllm:generation_tokens_total"] - before["nanovllm:generation_tokens_total"] < 900


def test_serving_benchmark(server, chat_model, tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/serving.py", "--base-url", server.url, "--num-prompts", "8",
         "--input-len", "16", "--output-len", "6", "--request-rate", "50", "--seed", "0",
         "--result-file", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_output_tokens"] == 8 * 6 and result["total_input_tokens"] == 8 * 16
    for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms"):
        assert result[key] > 0, key
    assert "Request throughput" in proc.stdout
