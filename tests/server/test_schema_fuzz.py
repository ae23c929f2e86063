"""Schema-driven fuzzing (schemathesis) of a real server on the embedded model, against its own /openapi.json.

Every operation gets requests generated from the published schema, valid ones and (where it takes input) invalid
ones; each answer must be no 5xx, a status the schema declares for the operation, a declared Content-Type, and a
body that matches the declared schema (the response models forbid undeclared fields, so what the handlers write
and what the schema says cannot drift apart). Each operation is bounded by its number of examples; small server
limits keep every generation short.
"""

from __future__ import annotations

import time

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server.conftest import ServerProcess  # noqa: E402

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]
# the operations the server publishes; those that take a body are fuzzed with invalid input too
OPERATIONS = {"POST /v1/completions": True, "POST /v1/chat/completions": True, "POST /tokenize": True,
              "POST /detokenize": True, "GET /v1/models": False, "GET /health": False, "GET /metrics": False}
# a valid request of each operation: its 200 answer goes through the same checks, whatever the fuzzer draws
VALID = {"POST /v1/completions": {"prompt": ["Hello", "Paris is"], "max_tokens": 3, "n": 2, "logprobs": 2,
                                  "echo": True, "return_token_ids": True},
         "POST /v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                       "logprobs": True, "top_logprobs": 2, "return_token_ids": True},
         "POST /tokenize": {"messages": [{"role": "user", "content": "Hi"}]},
         "POST /detokenize": {"tokens": [1, 2, 3]}}
EXAMPLES_PER_OPERATION = 25
SECONDS_PER_REQUEST = 60  # one request: at most 2 x 2 generations of < 64 tokens
SECONDS_PER_OPERATION = 600  # generous: a loaded 2-core machine; unloaded it takes seconds


@pytest.fixture(scope="module")
def embedded_server():
    from nanovllm.loader.default_model import embedded_model_path
    try:
        embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    # short generations: at most 64 tokens of context, 2 samples, 2 prompts a request
    proc = ServerProcess(None, "--max-model-len", "64", "--max-num-seqs", "4", "--max-n", "2",
                         "--max-prompts-per-request", "2", startup_timeout=240)
    yield proc
    assert proc.stop() == 0, proc.output()[-3000:]


@pytest.fixture(scope="module")
def published(embedded_server):
    return schemathesis.openapi.from_url(embedded_server.url + "/openapi.json")


def test_the_schema_publishes_every_operation(published):
    labels = {result.ok().label for result in published.get_all_operations()}
    assert labels == set(OPERATIONS)


CASES = [pytest.param(label, mode, id=f"{label}-{mode.value}") for label, takes_input in OPERATIONS.items()
         for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if takes_input or mode is GenerationMode.POSITIVE]


@pytest.mark.parametrize(("label", "mode"), CASES)
def test_every_answer_matches_the_published_schema(embedded_server, published, label, mode):
    operation = published.find_operation_by_label(label)
    assert operation is not None, label
    statuses: list[int] = []
    start = time.monotonic()
    if mode is GenerationMode.POSITIVE:  # the operation answers 200 with a body that matches its schema
        case = operation.Case(**({"body": VALID[label]} if label in VALID else {}))
        assert case.call_and_validate(checks=CHECKS, timeout=SECONDS_PER_REQUEST).status_code == 200

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        sent = time.monotonic()
        response = case.call_and_validate(checks=CHECKS, timeout=SECONDS_PER_REQUEST)
        assert time.monotonic() - sent < SECONDS_PER_REQUEST
        statuses.append(response.status_code)

    run()
    assert time.monotonic() - start < SECONDS_PER_OPERATION, statuses
    # the operation was reached, with many different bodies where it takes one (a GET without input has one form)
    assert len(statuses) >= (EXAMPLES_PER_OPERATION // 2 if OPERATIONS[label] else 1), statuses
    assert embedded_server.proc.poll() is None, embedded_server.output()[-3000:]


def test_the_schema_declares_responses_and_errors(embedded_server):
    import httpx

    spec = httpx.get(embedded_server.url + "/openapi.json").json()
    components = spec["components"]["schemas"]
    for path, ok in [("/v1/completions", "Completion"), ("/v1/chat/completions", "ChatCompletion"),
                     ("/tokenize", "TokenizeResponse"), ("/detokenize", "DetokenizeResponse")]:
        answers = spec["paths"][path]["post"]["responses"]
        assert answers["200"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{ok}"}
        for status in ("400", "401", "404", "413"):
            assert answers[status]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"}
        assert "422" not in answers  # invalid bodies are answered 400
    for path in ("/v1/completions", "/v1/chat/completions"):
        answers = spec["paths"][path]["post"]["responses"]
        assert "429" in answers and "text/event-stream" in answers["200"]["content"]
    assert {"CompletionChunk", "ChatCompletionChunk", "ModelList", "ErrorResponse", "ToolCall",
            "ToolCallDelta"} <= set(components)
    message = components["AssistantMessage"]["properties"]
    assert {"content", "tool_calls", "reasoning_content"} <= set(message)
    assert components["ChatCompletion"]["additionalProperties"] is False
    assert spec["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ModelList"}
    health = httpx.get(embedded_server.url + "/health")
    assert health.status_code == 200 and health.content == b"" and "content-type" not in health.headers
    assert spec["paths"]["/health"]["get"]["responses"]["200"].get("content", {}) == {}
