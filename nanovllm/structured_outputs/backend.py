"""The xgrammar backend: a compiler per tokenizer, compiling in a worker thread, and each request's matcher."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from nanovllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch  # only the engine core's sampler fills bitmasks; the server's front end runs without torch

# xgrammar 0.2's strings with a length bound take any character but quote, backslash, CR and LF: a control
# character (U+0000..U+001F) could be sampled, and JSON forbids it raw. The grammar text gets JSON's class.
_LOOSE_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'
# xgrammar's C++ errors start with "[time] /path/file.cc:line: "; the rest names the problem.
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def bitmask_width(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask: bit j of word w allows token 32 * w + j."""
    return (vocab_size + 31) // 32


def _message(error: BaseException) -> str:
    return _LOCATION.sub("", str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)


class GrammarBackend:
    """Compiles constraints for one tokenizer; safe to call from any thread.

    ``submit`` returns a future of the compiled grammar, computed in one worker thread and kept (a cache keyed by
    the constraint, so 64 requests with one schema compile it once). A constraint that cannot compile gives a
    future whose exception is a ValueError naming the problem.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, str], Future] = {}
        self._executor: ThreadPoolExecutor | None = None

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar
            info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=self.stop_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def submit(self, params: StructuredOutputsParams) -> Future:
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix="nanovllm-grammar")
                future = self._cache[key] = self._executor.submit(self._compile, params)
        return future

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar, waiting for it; raises ValueError if the constraint cannot compile."""
        return self.submit(params).result()

    def _compile(self, params: StructuredOutputsParams):
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer, and this model has none.")
        compiler = self._get_compiler()
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                schema = params.json if isinstance(params.json, dict) else {}
                import xgrammar
                # compact JSON (no free whitespace: a small model could spend its tokens on it)
                grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema if kind == "json" else
                                                                       {"type": "object"}),
                                                            any_whitespace=False, strict_mode=True)
                return compiler.compile_grammar(str(grammar).replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
            return compiler.compile_grammar(params.grammar)
        except Exception as e:
            raise ValueError(f"structured_outputs.{kind} cannot be used: {_message(e)}") from None

    def request_grammar(self, params: StructuredOutputsParams) -> RequestGrammar:
        return RequestGrammar(self.submit(params))

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One sample's position in its grammar: which tokens may come next, advanced by each sampled token."""

    def __init__(self, compiled: Future):
        self.compiled = compiled
        self._matcher = None

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    def error(self) -> BaseException | None:
        """The compile error once done (None while compiling or when it compiled)."""
        return self.compiled.exception() if self.compiled.done() else None

    @property
    def matcher(self):
        if self._matcher is None:
            import xgrammar
            self._matcher = xgrammar.GrammarMatcher(self.compiled.result())
        return self._matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of an int32 [rows, bitmask_width] CPU tensor."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar does not allow it."""
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The output is complete (a stop token was accepted, or the grammar admits nothing more)."""
        return self._matcher is not None and self._matcher.is_terminated()
