"""SamplingParams: how one request samples and when it stops (vLLM's fields and ranges, validated on construction)."""

from __future__ import annotations

import enum
import json as _json
import math
from dataclasses import dataclass

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# The most top-logprobs a request may ask for, per generated or prompt token (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a streamed request holds (vLLM's names)."""

    CUMULATIVE = 0  # everything so far: text, token ids and logprobs
    DELTA = 1  # only what is new since the previous output of the request
    FINAL_ONLY = 2  # nothing until the request finishes, then everything


def _check_number(name: str, value, *, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind}, got {value!r}.")
    if not integer and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}.")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}.")


def _check_logprobs(name: str, value) -> int | None:
    if value is None:
        return None
    if value is True:  # vLLM reads logprobs=True as 1
        return 1
    _check_number(name, value, integer=True)
    if value == -1 or value > MAX_LOGPROBS:  # -1 asks for the whole vocabulary: more than the cap
        raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {value}.")
    if value < 0:
        raise ValueError(f"{name} must be non-negative, got {value}.")
    return value


# OpenAI's range of a logit_bias value.
MAX_LOGIT_BIAS = 100.0


@dataclass
class StructuredOutputsParams:
    """A constraint on the whole output, vLLM's names: exactly one of the fields is set.

    json: a JSON schema (dict or its JSON text); json_object: any JSON object; regex: a regular expression;
    choice: one of these strings exactly; grammar: an EBNF grammar (GBNF, with a ``root`` rule).
    Plain data (picklable); the grammar itself is built by the engine (nanovllm/structured_outputs).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                             f"got {given or 'none'}.")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = _json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}.") from None
            if not isinstance(self.json, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {self.json!r}.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}.")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}.")
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {self.json_object!r}.")

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): the same constraint gives the same key (the compiled grammars' cache)."""
        value = getattr(self, self.kind)
        if self.kind in ("json", "choice"):
            return self.kind, _json.dumps(value, sort_keys=True, separators=(",", ":"))
        return self.kind, "" if self.kind == "json_object" else value


def _structured_outputs(value) -> StructuredOutputsParams | None:
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"json", "regex", "choice", "grammar", "json_object"})
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s) {unknown}; known: json, regex, choice, "
                             "grammar, json_object.")
        return StructuredOutputsParams(**value)
    raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {value!r}.")


def _token_id(name: str, value) -> int:
    """A token id given as an int or (OpenAI's logit_bias keys) a decimal string."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must hold non-negative token ids, got {value!r}.")
    return value


def _logit_bias(value) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must map token ids to numbers, got {value!r}.")
    out = {}
    for token, bias in value.items():
        token_id = _token_id("logit_bias", token)
        _check_number(f"logit_bias[{token!r}]", bias)
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias[{token!r}] must be in [-100, 100], got {bias}.")
        out[token_id] = float(bias)
    return out or None


@dataclass
class SamplingParams:
    """Sampling settings of one request, with vLLM's names, defaults, ranges and meaning.

    Order of operations on a row of logits (what the sampler does): ``min_tokens`` masks EOS and
    ``stop_token_ids``; the penalties; greedy takes the argmax here; otherwise divide by ``temperature``, then
    ``min_p``, ``top_k`` and ``top_p`` filter, and one token is drawn from what is left. ``logprobs`` report
    the model's raw distribution (log-softmax of the logits before any of these steps), as vLLM does by default.

    Fields:
      n: samples of the prompt returned in ``RequestOutput.outputs`` (they share the prompt's KV blocks).
      temperature: 0 (or below 1e-5) means greedy decoding; then top_p/top_k/min_p are reset to "off".
      top_p: in (0, 1]; keep the fewest most-likely tokens whose probability adds up to at least top_p.
      top_k: 0 or -1 = off; else keep the top_k most-likely tokens.
      min_p: in [0, 1]; drop tokens whose probability is below min_p times the most likely one's.
      presence_penalty, frequency_penalty: in [-2, 2]; subtracted from the logit of every token already
        generated (once, resp. once per occurrence). Prompt tokens do not count.
      repetition_penalty: > 0; tokens seen in the prompt or the output get their logit divided by it when
        positive, multiplied when negative (1 = off).
      seed: a per-request random generator, so the request draws the same tokens whatever else runs beside
        it; sample i of n > 1 uses seed + i. None (or -1) uses the engine's generator.
      stop: string(s) that end the output; cut from the text unless include_stop_str_in_output. Normalised
        to a list (None -> []).
      stop_token_ids: token ids that end the output (kept in token_ids; their text is left out). A list.
      ignore_eos: keep generating past EOS.
      max_tokens: the most tokens to generate; None = until max_model_len.
      min_tokens: no EOS or stop token id can be sampled before this many tokens.
      logprobs: None, or how many top alternatives to report per generated token (0..20), besides the sampled
        token's own log-probability; also turns on ``cumulative_logprob``.
      prompt_logprobs: None, or the same for each prompt token (the first prompt token has None).
      detokenize, skip_special_tokens, spaces_between_special_tokens: how token ids become text.
      include_stop_str_in_output: keep the matched stop string at the end of the text.
      structured_outputs: a StructuredOutputsParams (or its dict): only tokens the constraint allows can be
        sampled, and the output ends once it is complete.
      logit_bias: {token id: bias in [-100, 100]} added to the logits (OpenAI's; -100 bans, +100 forces).
      allowed_token_ids: only these tokens can be sampled (vLLM's).
      bad_words: words never generated (vLLM's): a word's last token is banned whenever the output ends with
        the word's other tokens (with and without a leading space).
      output_kind: a RequestOutputKind; what a streamed request's outputs hold (offline ``generate`` returns the
        finished outputs whatever it is).

    Plain data only (numbers, strings, lists, dicts, an int enum, a StructuredOutputsParams): a request's params cross the process boundary to the
    engine core as they are.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        _check_number("n", self.n, integer=True)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative (0 means greedy), got {self.temperature}.")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_number("top_k", self.top_k, integer=True)
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if self.top_k == -1:
            self.top_k = 0
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")

        if self.seed is not None:
            _check_number("seed", self.seed, integer=True)
            if self.seed == -1:
                self.seed = None

        if self.max_tokens is not None:
            _check_number("max_tokens", self.max_tokens, integer=True)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        _check_number("min_tokens", self.min_tokens, integer=True)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}.")

        self.logprobs = _check_logprobs("logprobs", self.logprobs)
        self.prompt_logprobs = _check_logprobs("prompt_logprobs", self.prompt_logprobs)

        for name in ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))

        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.") from None

        if self.stop is None:
            stops = []
        elif isinstance(self.stop, str):
            stops = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            stops = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if any(not s for s in stops):
            raise ValueError("stop cannot contain an empty string.")
        if stops and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True. "
                             "Set detokenize=True to use stop.")
        self.stop = list(dict.fromkeys(stops))  # normalised to a list, as vLLM does

        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must contain only non-negative integers, got {self.stop_token_ids!r}.")
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))

        self.structured_outputs = _structured_outputs(self.structured_outputs)
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, "
                                 f"got {self.allowed_token_ids!r}.")
            self.allowed_token_ids = list(dict.fromkeys(_token_id("allowed_token_ids", t)
                                                        for t in self.allowed_token_ids))
        if self.bad_words is not None:
            if isinstance(self.bad_words, str):
                self.bad_words = [self.bad_words]
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}.")
            self.bad_words = list(self.bad_words) or None

        if self.temperature < SAMPLING_EPS:
            # Greedy: the filters cannot change an argmax, so turn them off (as vLLM does).
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def reads_output(self) -> bool:
        """Sampling the next token reads the tokens generated so far (beyond min_tokens): penalties, bad words,
        a structured-outputs grammar. Such a request's step cannot be planned before the previous token is known."""
        return self.has_penalties or bool(self.bad_words) or self.structured_outputs is not None

    @property
    def masks_logits(self) -> bool:
        """Some tokens' logits change before sampling (besides min_tokens and penalties)."""
        return (self.structured_outputs is not None or self.logit_bias is not None
                or self.allowed_token_ids is not None or bool(self.bad_words))
