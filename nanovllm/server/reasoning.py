"""Reasoning parsers (``--reasoning-parser``): split a model's ``<think>...</think>`` into ``reasoning_content``.

``qwen3``: the output reasons only when it opens ``<think>``, or when the prompt left one open (a template that
starts the thinking itself); ``enable_thinking: false`` templates close it in the prompt, so all is content.
``deepseek_r1``: the output always starts inside the reasoning (its template opens it); a leading ``<think>`` is
dropped. Both end the reasoning at ``</think>``; until it comes, the text is reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def check_reasoning_parser(name: str | None) -> None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not known; choose one of {list(REASONING_PARSERS)}.")


def held_back(text: str, tag: str) -> int:
    """Characters at the end of text that could be the start of tag (held back while streaming)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ReasoningSplitter:
    """Splits one output; ``split`` is given the whole text so far each time (so it serves streams too)."""

    parser: str
    prompt_opens_reasoning: bool = False

    @classmethod
    def for_prompt(cls, parser: str, prompt_text: str) -> ReasoningSplitter:
        tail = prompt_text[prompt_text.rfind(END) + len(END):] if END in prompt_text else prompt_text
        return cls(parser, START in tail)  # a <think> after the last </think>: the prompt left it open

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning or None, content). Not final: a possible partial tag at the end is held back, so what it
        returns only grows from one call to the next."""
        stripped = text.lstrip()
        opens = stripped.startswith(START)
        if not final and not opens and START.startswith(stripped) and stripped:
            return None, ""  # maybe the start of <think>
        if self.parser == "qwen3" and not opens and not self.prompt_opens_reasoning:
            return None, text
        body = stripped[len(START):] if opens else text
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END):]
        if not final:
            body = body[:len(body) - held_back(body, END)]
        return body, ""
