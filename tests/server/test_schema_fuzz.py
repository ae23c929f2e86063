"""Schema-driven fuzzing (schemathesis) of a real server on the embedded model, against its own /openapi.json.

Every route gets requests generated from the published schema, valid and invalid; each answer must be no 5xx, a
status the schema declares for the route, a declared Content-Type, and a body that matches the declared schema.
Small limits keep each generation short, so the whole run stays within about a minute.
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
EXAMPLES_PER_ROUTE = 12
SECONDS_PER_REQUEST = 60


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


def operations(url: str):
    for result in schemathesis.openapi.from_url(url + "/openapi.json").get_all_operations():
        yield result.ok()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_answer_matches_the_published_schema(embedded_server, mode):
    tried: dict[str, int] = {}
    answered: set[str] = set()  # routes that answered 200 at least once: their bodies were checked
    for operation in operations(embedded_server.url):
        if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # the GETs take no input: nothing to get wrong

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            start = time.monotonic()
            response = case.call_and_validate(checks=CHECKS, timeout=SECONDS_PER_REQUEST)
            assert time.monotonic() - start < SECONDS_PER_REQUEST
            tried[case.operation.label] = tried.get(case.operation.label, 0) + 1
            if response.status_code == 200:
                answered.add(case.operation.label)

        run()
    # every route was reached; the four that take a body, with many different ones
    assert len(tried) == (7 if mode is GenerationMode.POSITIVE else 4), tried
    assert sum(tried.values()) >= 4 * EXAMPLES_PER_ROUTE, tried
    if mode is GenerationMode.POSITIVE:
        assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models"} <= answered, answered
    assert embedded_server.proc.poll() is None


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
    assert {"CompletionChunk", "ChatCompletionChunk", "ModelList", "ErrorResponse"} <= set(components)
    assert spec["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ModelList"}
    health = httpx.get(embedded_server.url + "/health")
    assert health.status_code == 200 and health.content == b"" and "content-type" not in health.headers
    assert spec["paths"]["/health"]["get"]["responses"]["200"].get("content", {}) == {}
