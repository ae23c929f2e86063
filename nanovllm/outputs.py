"""Results shaped like vLLM's: a RequestOutput per prompt holding one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", or None while unfinished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    # The first sample's fields, for the common n=1 case; also reachable as out["text"] etc.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    def __getitem__(self, key: str):
        if key in ("text", "token_ids", "finish_reason"):
            return getattr(self, key)
        if key in ("request_id", "prompt", "prompt_token_ids", "outputs", "finished"):
            return getattr(self, key)
        raise KeyError(key)
