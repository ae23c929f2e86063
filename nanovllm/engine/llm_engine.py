"""LLMEngine: accepts requests, runs engine steps (schedule -> run -> postprocess) and builds outputs."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from dataclasses import dataclass, field

from nanovllm.chat_template import apply_chat_template
from nanovllm.config import EngineConfig, model_max_len
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.input_processor import InputProcessor, Prompt, RequestLimits
from nanovllm.engine.sampling import RunnerOutput, TokenLogprobs
from nanovllm.engine.scheduler import Scheduler, SchedulerConfig
from nanovllm.engine.sequence import Sequence, SequenceExtras, SequenceStatus
from nanovllm.loader.source import resolve_model
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from nanovllm.structured_outputs import GrammarBackend

logger = logging.getLogger(__name__)

# A step with nothing to run but requests whose grammar compiles waits this long for one (seconds).
GRAMMAR_WAIT_SECONDS = 0.05


@dataclass
class SampleState:
    """One of a request's n samples: its sequence, text and logprobs."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer | None  # None without a tokenizer or with detokenize=False
    logprobs: list[dict[int, Logprob]] | None = None  # with SamplingParams.logprobs
    cumulative_logprob: float | None = None
    num_sent_tokens: int = 0  # token ids (and logprobs) already in an output, for output_kind DELTA
    num_sent_chars: int = 0  # text already in an output, for output_kind DELTA


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    pending: list[Sequence] = field(default_factory=list)  # samples 1..n-1 waiting for sample 0's prompt
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # with SamplingParams.prompt_logprobs
    num_prompt_logprobs_missing: int = 0
    num_cached_tokens: int | None = None  # prompt tokens sample 0 found in the prefix cache
    error: str | None = None  # why processing this request failed (its samples end with finish_reason "error")

    @property
    def finished(self) -> bool:
        return all(sample.seq.is_finished for sample in self.samples)


@dataclass
class StepStats:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    seconds: float = 0.0


class LLMEngine:
    def __init__(self, model: str | None = None, **engine_args):
        unknown = sorted(set(engine_args) - set(EngineConfig.field_names()))
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {EngineConfig.field_names()}")
        self.config = config = EngineConfig(model=model, **engine_args)
        source = resolve_model(config.model, config.tokenizer)
        self.model_path = source.path
        self.hf_config = source.hf_config
        self.tokenizer = source.tokenizer
        self.eos_token_ids = source.eos_token_ids
        self.vocab_size = int(self.hf_config.vocab_size)

        limit = model_max_len(self.hf_config)
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} is beyond the model's limit of {limit} tokens "
                             "(max_position_embeddings, stretched by a YaRN rope_scaling factor if config.json has "
                             "one: Qwen3 reaches 131,072 with {'rope_type': 'yarn', 'factor': 4.0, "
                             "'original_max_position_embeddings': 32768}).")
        self.max_model_len = config.max_model_len or limit

        if config.tensor_parallel_size > 1:
            from nanovllm.distributed.workers import TensorParallelRunner
            self.runner = TensorParallelRunner(config, source, self.max_model_len)
        else:
            from nanovllm.engine.model_runner import ModelRunner
            self.runner = ModelRunner(config, self.hf_config, source.path, self.max_model_len)
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            num_kvcache_blocks=self.num_kvcache_blocks,
            kvcache_block_size=config.kvcache_block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            prefix_caching_hash_algo=config.prefix_caching_hash_algo,
            speculative=config.speculative_config,
        ), self.eos_token_ids)
        self.closed = False
        self.requests: dict[str, RequestState] = {}
        self._request_counter = itertools.count()
        self._token_texts: dict[int, str] = {}  # token id -> its text, for logprobs
        self.last_step = StepStats()
        self._in_flight = None  # the step launched ahead (asynchronous scheduling), not yet read
        self.async_scheduling = config.async_scheduling_enabled and hasattr(self.runner, "launch")
        self.grammars = GrammarBackend(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        self._compiling: list[Sequence] = []  # requests held back until their grammar is compiled
        self.request_limits = RequestLimits(
            max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            kv_capacity_tokens=self.num_kvcache_blocks * config.kvcache_block_size,
            supports_prompt_logprobs=(config.tensor_parallel_size == 1
                                      or getattr(self.runner, "supports_prompt_logprobs", False)))
        self.input_processor = InputProcessor(self.tokenizer, self.request_limits)

    # -- requests -------------------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a string, a list of token ids, or {"prompt_token_ids": [...]}."""
        return self.input_processor.tokenize_prompt(prompt)

    def validate_request(self, token_ids: list[int], params: SamplingParams) -> None:
        self.input_processor.validate_request(token_ids, params)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        return apply_chat_template(self.tokenizer, conversation, add_generation_prompt, chat_template_kwargs)

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (its n samples) and return its id.

        Sample 0 goes to the scheduler now; samples 1..n-1 join once sample 0's prompt is computed (right after
        its first token), so they find the prompt's full blocks in the prefix cache instead of recomputing them.
        """
        if self.closed:
            raise RuntimeError("this engine is closed: it takes no more requests.")
        params = sampling_params if sampling_params is not None else SamplingParams()
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_request(token_ids, params)
        request_id = str(next(self._request_counter)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use.")
        stop_ids = tuple(sorted(t for t in set(self.scheduler.eos_token_ids) | set(params.stop_token_ids)
                                if 0 <= t < self.vocab_size))
        bad_words = self._bad_words_token_ids(params.bad_words) if params.bad_words else ()
        samples = []
        for index in range(params.n):
            grammar = None
            if params.structured_outputs is not None:
                grammar = self.grammars.request_grammar(params.structured_outputs)
            extras = SequenceExtras(
                request_id=request_id, index=index, min_tokens_stop_ids=stop_ids if params.min_tokens > 0 else (),
                needs_prompt_logprobs=index == 0 and params.prompt_logprobs is not None and len(token_ids) > 1,
                bad_words_token_ids=bad_words, grammar=grammar)
            seq = Sequence(token_ids, params, block_size=self.config.kvcache_block_size, extras=extras)
            detokenizer = None
            if self.tokenizer is not None and params.detokenize:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer, token_ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output, min_tokens=params.min_tokens)
            with_logprobs = params.logprobs is not None
            samples.append(SampleState(seq, detokenizer, [] if with_logprobs else None,
                                       0.0 if with_logprobs else None))
        state = RequestState(request_id, text, token_ids, params, samples, pending=[s.seq for s in samples[1:]])
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(token_ids)
            state.num_prompt_logprobs_missing = len(token_ids) - 1
        self.requests[request_id] = state
        grammar = samples[0].seq.extras.grammar
        if grammar is not None and not grammar.ready:
            self._compiling.append(samples[0].seq)  # scheduled once compiled (_admit_compiled)
        else:
            self.scheduler.add(samples[0].seq)
        return request_id

    def _bad_words_token_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word as token ids, alone and after a space (as it reads mid-sentence), as vLLM does."""
        out = []
        for word in words:
            for text in (word.strip(), " " + word.strip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in out:
                    out.append(ids)
        return tuple(out)

    def check_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """Compile the constraint now (cached for the request that follows); ValueError naming the problem if it
        cannot be used (a model without tokenizer too). Callable from any thread."""
        self.grammars.compile(params)

    def _admit_compiled(self) -> None:
        """Schedule the requests whose grammar is compiled now; one whose grammar failed fails (its error)."""
        waiting = []
        for seq in self._compiling:
            if seq.is_finished:  # aborted while compiling
                continue
            grammar = seq.extras.grammar
            if not grammar.ready:
                waiting.append(seq)
                continue
            error = grammar.error()
            state = self.requests.get(seq.extras.request_id)
            if error is not None:
                if state is not None:
                    self._fail_request(state, error)
            else:
                self.scheduler.add(seq)
        self._compiling = waiting

    def _advance_grammars(self, seqs: list[Sequence], token_ids: list[int | None]) -> None:
        """Feed each constrained sequence's new token to its grammar; a complete output ends the sequence."""
        for seq, token_id in zip(seqs, token_ids, strict=True):
            if token_id is None:
                continue
            extras = seq.extras
            grammar = extras.grammar
            if grammar is None or extras.finish_reason == "abort":
                continue
            if not grammar.accept(token_id):
                state = self.requests.get(extras.request_id)
                if state is not None:
                    self._fail_request(state, ValueError(
                        f"token {token_id} does not fit the structured_outputs grammar (no allowed token was left: "
                        "min_tokens or other bans conflict with it)."), state.samples[extras.index])
            elif grammar.is_terminated and not seq.is_finished:
                self.scheduler.finish(seq, "stop")

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and forget it; False if it is unknown or had already finished."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        aborted = False
        for sample in state.samples:
            seq = sample.seq
            if seq.is_finished:
                continue
            if not self.scheduler.abort(seq):  # a sample not yet handed to the scheduler
                seq.status = SequenceStatus.FINISHED
                seq.extras.finish_reason = "abort"
            aborted = True
        return aborted

    def stop_sample(self, request_id: str, index: int, stop: str) -> bool:
        """End one sample whose text reached the stop string ``stop`` (found by a caller that detokenizes the
        outputs itself); it leaves the batch and frees its KV blocks now. False if it had finished already."""
        state = self.requests.get(request_id)
        if state is None or index >= len(state.samples) or state.samples[index].seq.is_finished:
            return False
        self.scheduler.finish(state.samples[index].seq, "stop", stop)
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's content, as vLLM's LLM.reset_prefix_cache (e.g. between benchmark runs);
        blocks that running requests hold are kept. True once done."""
        self.scheduler.block_manager.reset_prefix_cache()
        return True

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished() or bool(self._compiling)

    def is_request_finished(self, request_id: str) -> bool:
        return self.requests[request_id].finished

    # -- steps --------------------------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one engine step; returns the sequences that received a token (finished ones included), and those
        of a request that failed this step (finish_reason "error", see ``_fail_request``).

        A sequence's ``extras`` carry ``request_id`` (its request) and ``index`` (which of the request's n samples); a
        request is finished when ``is_request_finished`` says so (every sample finished).
        """
        start = time.perf_counter()
        if self._compiling:
            self._admit_compiled()
        current, self._in_flight = self._in_flight, None
        if current is not None and all(s.is_finished for s in current.seqs):
            current = None  # every request of the planned step ended meanwhile: nothing of it is wanted
        if current is None:
            seqs = self.scheduler.schedule()
            if not seqs:
                self.last_step = StepStats()
                if self._compiling:  # nothing to run until a grammar is ready: wait for one, briefly
                    concurrent.futures.wait([s.extras.grammar.compiled for s in self._compiling], GRAMMAR_WAIT_SECONDS,
                                            return_when=concurrent.futures.FIRST_COMPLETED)
                return []
            for seq in seqs:
                if seq.is_prefill and seq.extras.index == 0:
                    state = self.requests.get(seq.extras.request_id)
                    if state is not None and state.num_cached_tokens is None:
                        state.num_cached_tokens = seq.num_cached_tokens  # what the prefix cache served
            try:
                current = self._launch(seqs)
            except BaseException:
                self.scheduler.undo_step(seqs)
                raise
        seqs = current.seqs
        prefill = sum(s.num_scheduled_tokens for s in seqs if s.is_prefill)
        decoding = [not s.is_prefill for s in seqs]
        try:
            if self.async_scheduling:
                # plan and launch the next step before reading this one's tokens: the device never waits for the
                # host
                ahead = self.scheduler.schedule_ahead(seqs)
                if ahead:
                    self._in_flight = self.runner.launch(ahead, after=current)
            output = current.result()
        except BaseException:
            self.scheduler.undo_step(seqs)  # (a step planned ahead holds decodes only: it is simply dropped)
            self._in_flight = None
            raise
        ended = [seq.is_finished for seq in seqs]  # while the step ran (aborted, or stopped by the step before)
        for i in (i for i, e in enumerate(ended) if e):
            output.token_ids[i] = output.logprobs[i] = None  # drop its token
            output.prompt_logprobs.pop(i, None)
        self.scheduler.postprocess(seqs, output.token_ids)
        self._advance_grammars(seqs, output.token_ids)
        decode = sum(len(t) if isinstance(t, list) else 1
                     for t, d in zip(output.token_ids, decoding, strict=True) if d and t is not None)
        self._record(seqs, output)
        if self._in_flight is not None:
            for seq in self._in_flight.seqs:
                if not seq.is_finished:
                    seq.num_scheduled_tokens = 1  # its token in flight, now appended, is what the next step computes
        self.last_step = StepStats(prefill, decode, time.perf_counter() - start)
        return [s for s, t, e in zip(seqs, output.token_ids, ended, strict=True)
                if not e and (t is not None or s.extras.finish_reason == "error")]

    def _launch(self, seqs: list[Sequence]):
        """Start a scheduled step (a runner without ``launch`` runs it to the end here)."""
        launch = getattr(self.runner, "launch", None)
        if launch is not None:
            return launch(seqs)
        return _FinishedStep(seqs, self.runner.run(seqs))

    def _record(self, seqs: list[Sequence], output: RunnerOutput) -> None:
        """Take in the step's logprobs, check stop strings, and start the other samples of n > 1 requests.

        This is per-request work on the request's own data (its text, its logprobs): an exception here fails that
        request alone (``_fail_request``), and the step goes on for the others.
        """
        for i, run in output.prompt_logprobs.items():
            state = self.requests.get(seqs[i].extras.request_id)
            if state is None or state.prompt_logprobs is None or state.error is not None:
                continue
            try:
                for position, entry in enumerate(run.entries, start=run.first_position):
                    if state.prompt_logprobs[position] is None:
                        state.num_prompt_logprobs_missing -= 1
                    state.prompt_logprobs[position] = self._logprob_dict(entry)
            except Exception as e:
                self._fail_request(state, e)
                continue
            if state.num_prompt_logprobs_missing == 0:
                seqs[i].extras.needs_prompt_logprobs = False  # a recompute after preemption needs no logits again
        for seq, token_id, logprobs in zip(seqs, output.token_ids, output.logprobs, strict=True):
            params = seq.sampling_params
            if token_id is None or (not params.stop and params.logprobs is None and params.n == 1):
                continue  # nothing to record per step: its text and output wait for make_output
            extras = seq.extras
            state = self.requests.get(extras.request_id)
            if state is None or state.error is not None:
                continue
            sample = state.samples[extras.index]
            try:
                num_new = len(token_id) if isinstance(token_id, list) else 1  # a verify step's kept tokens
                if state.params.stop and num_new > 1:
                    num_new = self._update_text_stepwise(sample, num_new)
                elif state.params.stop:
                    self._update_text(sample)  # stop strings are checked every step; other text waits for make_output
                if sample.logprobs is not None and logprobs is not None:
                    for entry in (logprobs if isinstance(logprobs, list) else [logprobs])[:num_new]:
                        sample.logprobs.append(self._logprob_dict(entry))
                        sample.cumulative_logprob += entry.logprob
            except Exception as e:
                self._fail_request(state, e, sample)
                continue
            if state.pending:
                for child in state.pending:  # sample 0's prompt blocks are cached now: the rest share them
                    self.scheduler.add(child, first=True)
                state.pending = []

    def _fail_request(self, state: RequestState, error: BaseException, sample: SampleState | None = None) -> None:
        """Contain a fault met while processing one request: it ends, and the engine and other requests go on.

        Every unfinished sample (and ``sample``, the one whose processing raised, even if it had finished) ends
        with finish_reason "error"; unfinished ones leave the scheduler and free their KV blocks now. The
        request stays in ``requests`` until its output is taken, as any finished request does; ``state.error``
        says what went wrong.
        """
        if state.error is None:
            logger.error("request %s failed and was stopped; the engine goes on", state.request_id,
                         exc_info=(type(error), error, error.__traceback__))
            state.error = f"{type(error).__name__}: {error}"
        state.pending = []  # samples never handed to the scheduler hold no blocks
        for other in state.samples:
            seq = other.seq
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")  # frees its blocks; a sample not queued yet holds none
            elif other is sample:
                seq.extras.finish_reason, seq.extras.stop_reason = "error", None

    def _update_text_stepwise(self, sample: SampleState, num_new: int) -> int:
        """``_update_text`` for a step that appended several tokens (speculative decoding): they go to the
        detokenizer one at a time, so a stop string ends the sample at the token that completed it, as in plain
        decoding, and the tokens after that one are dropped. Returns how many of the new tokens are kept."""
        seq, detokenizer = sample.seq, sample.detokenizer
        first = seq.num_tokens - num_new
        for end in range(first + 1, seq.num_tokens):  # the last new token goes through _update_text
            done = seq.num_prompt_tokens + detokenizer.num_tokens
            stop = detokenizer.update(seq.token_ids[done:end]) if done < end else None
            if stop is not None:
                if seq.is_finished:  # by the last new token, which is dropped now
                    seq.extras.finish_reason, seq.extras.stop_reason = "stop", stop
                else:
                    self.scheduler.finish(seq, "stop", stop)
                seq.truncate(end)
                detokenizer.finish()
                return end - first
        self._update_text(sample)
        return num_new

    def _update_text(self, sample: SampleState) -> None:
        """Feed the sample's new tokens to its detokenizer; a stop string ends the sample with reason "stop"."""
        seq, detokenizer = sample.seq, sample.detokenizer
        end = seq.num_completion_tokens
        extras = seq.extras
        stopped_by_token = extras.finish_reason == "stop" and not isinstance(extras.stop_reason, str)
        if stopped_by_token and not seq.sampling_params.include_stop_str_in_output:
            end -= 1  # the EOS / stop token's text is left out, as vLLM does
        stop = None
        if detokenizer.num_tokens < end:
            base = seq.num_prompt_tokens
            stop = detokenizer.update(seq.token_ids[base + detokenizer.num_tokens:base + end])
        if seq.is_finished and stop is None:
            stop = detokenizer.finish()
        if stop is not None:
            if seq.is_finished:  # it also reached its length limit with this token: the stop string wins
                extras.finish_reason, extras.stop_reason = "stop", stop
            else:
                self.scheduler.finish(seq, "stop", stop)
            detokenizer.finish()

    def _logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        """{token id: Logprob}: the scored token first, then the top alternatives (ranks 1, 2, ...)."""
        result = {entry.token_id: Logprob(entry.logprob, entry.rank, self._token_text(entry.token_id))}
        for rank, (token_id, logprob) in enumerate(zip(entry.top_ids, entry.top_logprobs, strict=True), start=1):
            if token_id not in result:
                result[token_id] = Logprob(logprob, rank, self._token_text(token_id))
        return result

    def _token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    # -- outputs ------------------------------------------------------------------------------------------------
    def make_output(self, request_id: str) -> RequestOutput:
        """The request's output now, one CompletionOutput per sample (index 0..n-1), as its ``output_kind`` says:
        everything so far (CUMULATIVE, FINAL_ONLY) or only what is new since the previous call (DELTA).

        For streaming. While a sample is unfinished, its ``text`` is the text of its tokens so far, minus any
        ending that could still become the start of a stop string (held back until decided) and minus an
        incomplete multi-byte character; so between two calls ``text`` only grows (a DELTA output holds the new
        suffix), and the finished text is final (stop string cut, unless include_stop_str_in_output). token_ids
        and logprobs (one entry per token id) also only grow. Call it from the thread that steps the engine.
        """
        state = self.requests[request_id]
        delta = state.params.output_kind == RequestOutputKind.DELTA
        # texts first: a sample whose text fails ends the whole request, before any output is built
        texts = [self._sample_text(state, sample) for sample in state.samples]
        outputs = []
        for sample, text in zip(state.samples, texts, strict=True):
            seq = sample.seq
            extras = seq.extras
            if delta:  # slices of what is new only: no work that grows with the output's length
                first = sample.num_sent_tokens
                token_ids = seq.token_ids[seq.num_prompt_tokens + first:]
                logprobs = sample.logprobs[first:] if sample.logprobs is not None else None
                sample.num_sent_tokens += len(token_ids)
                text, sample.num_sent_chars = text[sample.num_sent_chars:], len(text)
            else:
                token_ids = seq.completion_token_ids
                logprobs = list(sample.logprobs) if sample.logprobs is not None else None
            outputs.append(CompletionOutput(
                index=extras.index, text=text, token_ids=token_ids, finish_reason=extras.finish_reason,
                stop_reason=extras.stop_reason, cumulative_logprob=sample.cumulative_logprob, logprobs=logprobs))
        prompt_logprobs = list(state.prompt_logprobs) if state.prompt_logprobs is not None else None
        return RequestOutput(request_id=request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
                             outputs=outputs, finished=state.finished, num_cached_tokens=state.num_cached_tokens or 0,
                             prompt_logprobs=prompt_logprobs)

    def _sample_text(self, state: RequestState, sample: SampleState) -> str:
        """The sample's text so far; a detokenizer that raises fails the request (its text stays as it was)."""
        detokenizer = sample.detokenizer
        if detokenizer is None:
            return ""
        if sample.seq.extras.finish_reason != "error":
            try:
                self._update_text(sample)
                return detokenizer.output_text(sample.seq.is_finished)
            except Exception as e:
                self._fail_request(state, e, sample)
        return detokenizer.text if isinstance(detokenizer.text, str) else ""

    def request_error(self, request_id: str) -> str | None:
        """Why the request failed (its samples ended with finish_reason "error"); None if it did not."""
        state = self.requests.get(request_id)
        return None if state is None else state.error

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def pop_finished(self, request_id: str) -> RequestOutput:
        output = self.make_output(request_id)
        self.forget_request(request_id)
        return output

    def forget_request(self, request_id: str) -> None:
        """Drop a finished request whose final output was taken (with ``make_output``)."""
        assert self.requests[request_id].finished
        del self.requests[request_id]

    def close(self) -> None:
        """Release the runner (its workers, KV pool, CUDA graphs); idempotent."""
        self.closed = True
        grammars = getattr(self, "grammars", None)
        if grammars is not None:
            grammars.close()
        runner = getattr(self, "runner", None)
        if runner is not None and hasattr(runner, "close"):
            runner.close()


@dataclass
class _FinishedStep:
    """A step some runner ran to the end; the same ``result()`` as a launched step."""

    seqs: list[Sequence]
    output: RunnerOutput

    def result(self) -> RunnerOutput:
        return self.output

