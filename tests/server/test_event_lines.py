"""Every server-sent event is one line to any client's line reader, whatever text it carries.

JSON may hold U+0085, U+2028 and U+2029 raw, but httpx's ``aiter_lines`` (and ``str.splitlines``) end a line at
each of them; a raw one cut a streamed chunk in two, and the client's JSON decode failed.
"""

import json

import httpx
import pytest

from nanovllm.server.app import _ChunkTemplate, _event

TEXTS = ["a\u2028b", "line\u2029", "\x85", "é \u2028\u2029\x85 ok", "tab\tcr\rnl\n\x1c\x1d\x1e\x0b\x0c"]


def _events(text: str) -> list[tuple[str, object]]:
    template = _ChunkTemplate("cmpl-1", "text_completion", 1, "m", include_usage=True, return_token_ids=True)
    return [
        (_event({"choices": [{"index": 0, "text": text}]}), text),
        (template.completion(0, text, [1, 2]), text),
        (template.chat(0, {"content": text}, [3]), text),
    ]


def _lines_httpx_reads(event: str) -> list[str]:
    decoder = httpx._decoders.LineDecoder()
    return [line for line in decoder.decode(event) + decoder.flush() if line]


@pytest.mark.parametrize("text", TEXTS)
def test_an_event_is_one_line_to_every_reader(text):
    for event, sent in _events(text):
        assert event.endswith("\n\n") and event.startswith("data: ")
        for lines in (_lines_httpx_reads(event), [line for line in event.splitlines() if line]):
            assert len(lines) == 1, lines
            payload = json.loads(lines[0].removeprefix("data: "))
            choice = payload["choices"][0]
            assert choice.get("text", choice.get("delta", {}).get("content")) == sent
