"""One chat choice's text as OpenAI's message parts: reasoning_content, content and tool_calls, streamed or not.

The reasoning parser (server/reasoning.py) splits off the reasoning first; the rest goes through the tool-call
reading of the request's plan (server/tools.py). Both read the whole text so far, so a stream's deltas add up to
exactly the non-streamed message; a choice with neither passes each new piece of text straight through.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanovllm.server.reasoning import ReasoningSplitter
from nanovllm.server.tools import ToolCallStream, ToolPlan


@dataclass
class ChatChoiceOutput:
    plan: ToolPlan
    reasoning: ReasoningSplitter | None = None
    sent_reasoning: int = 0
    content: list[str] = field(default_factory=list)
    reasoning_text: list[str] = field(default_factory=list)
    tools: ToolCallStream = None
    text: str = ""  # the whole text so far (kept only when a parser reads it)

    def __post_init__(self) -> None:
        self.tools = ToolCallStream(self.plan)

    def delta(self, new_text: str, final: bool) -> dict:
        """The message parts that ``new_text`` (the text since the last call) adds: {"reasoning_content"?,
        "content"?, "tool_calls"?}."""
        if self.reasoning is None and self.plan.mode == "none":
            if new_text:
                self.content.append(new_text)
                return {"content": new_text}
            return {}
        out: dict = {}
        self.text += new_text
        text = content_text = self.text
        if self.reasoning is not None:
            reasoning, content_text = self.reasoning.split(text, final)
            if reasoning is not None and len(reasoning) > self.sent_reasoning:
                out["reasoning_content"] = reasoning[self.sent_reasoning:]
                self.reasoning_text.append(out["reasoning_content"])
                self.sent_reasoning = len(reasoning)
        content, calls = self.tools.update(content_text, final)
        if content:
            out["content"] = content
            self.content.append(content)
        if calls:
            out["tool_calls"] = calls
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.tools.calls and reason == "stop" else reason

    def message(self, text: str) -> dict:
        """The whole message of a finished (non-streamed) choice, from its whole text."""
        self.delta(text, final=True)
        message = {"role": "assistant", "content": "".join(self.content) if self.content or not self.tools.calls
                   else None}
        if self.reasoning is not None:
            message["reasoning_content"] = "".join(self.reasoning_text) if self.reasoning_text else None
        if self.tools.calls:
            message["tool_calls"] = self.tools.calls
        return message
