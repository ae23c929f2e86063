"""Results shaped like vLLM's: a RequestOutput per prompt holding one CompletionOutput per sample.

Both also answer dict-style access (``out["text"]``), which older callers of this engine use. What an output
holds follows its request's ``SamplingParams.output_kind``: everything so far (CUMULATIVE), only what is new since
the request's previous output (DELTA), or everything once finished (FINAL_ONLY).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """A token's log-probability under the model's raw distribution, as vLLM reports it."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None  # the token's own text


# Per generated token: {token id: Logprob} with the sampled token and the top-``logprobs`` alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token; the first is None (nothing precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", or None while unfinished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None for EOS)
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs; only with logprobs
    logprobs: SampleLogprobs | None = None  # one entry per token id; only with logprobs

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __getitem__(self, key: str):
        if key in _COMPLETION_KEYS:
            return getattr(self, key)
        raise KeyError(key)


_COMPLETION_KEYS = ("index", "text", "token_ids", "finish_reason", "stop_reason", "cumulative_logprob", "logprobs")


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)  # index 0..n-1
    finished: bool = False  # every sample finished
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: PromptLogprobs | None = None

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

    def add(self, later: RequestOutput) -> None:
        """Fold a later DELTA output of the same request into this one (a consumer that fell behind reads both
        at once): texts, token ids and logprobs are appended, finish fields and counters taken from ``later``."""
        by_index = {c.index: c for c in self.outputs}
        for c in later.outputs:
            mine = by_index.get(c.index)
            if mine is None:
                self.outputs.append(c)
                by_index[c.index] = c
                continue
            mine.text += c.text
            mine.token_ids = mine.token_ids + c.token_ids
            if c.logprobs is not None:
                mine.logprobs = (mine.logprobs or []) + c.logprobs
            mine.cumulative_logprob = c.cumulative_logprob
            mine.finish_reason, mine.stop_reason = c.finish_reason, c.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs

    def __getitem__(self, key: str):
        if key in ("request_id", "prompt", "prompt_token_ids", "outputs", "finished", "num_cached_tokens",
                   "prompt_logprobs"):
            return getattr(self, key)
        if key in _COMPLETION_KEYS:
            return self.outputs[0][key]
        raise KeyError(key)
