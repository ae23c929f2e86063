"""LLMEngine: accepts requests, runs engine steps (schedule -> run -> postprocess) and builds outputs."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

from nanovllm.config import EngineConfig, model_max_len
from nanovllm.engine.scheduler import Scheduler, SchedulerConfig
from nanovllm.engine.sequence import Sequence
from nanovllm.loader.source import resolve_model
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int] | dict


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
            raise ValueError(f"max_model_len {config.max_model_len} is beyond the model's limit of {limit} tokens.")
        self.max_model_len = config.max_model_len or limit

        Sequence.block_size = config.kvcache_block_size
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
        ), self.eos_token_ids)
        self.requests: dict[str, tuple[Sequence, str | None]] = {}
        self._request_counter = itertools.count()
        self.last_step = StepStats()

    # -- requests -------------------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a string, a list of token ids, or {"prompt_token_ids": [...]}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one token.")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompts as lists of token ids.")
            return prompt, self._check_token_ids(self.tokenizer.encode(prompt))
        if isinstance(prompt, SequenceABC):
            return None, self._check_token_ids(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}.")

    def _check_token_ids(self, token_ids) -> list[int]:
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token.")
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t!r} is outside the vocabulary [0, {self.vocab_size}).")
        return token_ids

    def validate_request(self, token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens, but max_model_len is {self.max_model_len}: it must be "
                             f"shorter, leaving room for at least one generated token.")
        longest = min(n + params.max_tokens, self.max_model_len)
        capacity = self.num_kvcache_blocks * self.config.kvcache_block_size
        if longest > capacity:
            raise ValueError(f"the request needs up to {longest} tokens of KV cache (prompt {n} + max_tokens "
                             f"{params.max_tokens}), but the whole pool holds {capacity}; raise "
                             f"num_kvcache_blocks or the KV cache memory, or lower max_tokens.")

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = sampling_params if sampling_params is not None else SamplingParams()
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_request(token_ids, params)
        request_id = str(next(self._request_counter)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use.")
        seq = Sequence(token_ids, params)
        self.requests[request_id] = (seq, text)
        seq.request_id = request_id
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        entry = self.requests.pop(request_id, None)
        if entry is None:
            return False
        return self.scheduler.abort(entry[0])

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished()

    # -- steps --------------------------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one engine step; returns the sequences that received a token (finished ones included)."""
        start = time.perf_counter()
        seqs = self.scheduler.schedule()
        if not seqs:
            self.last_step = StepStats()
            return []
        prefill = sum(s.num_scheduled_tokens for s in seqs if s.is_prefill)
        decode = sum(1 for s in seqs if not s.is_prefill)
        token_ids = self.runner.run(seqs)
        self.scheduler.postprocess(seqs, token_ids)
        self.last_step = StepStats(prefill, decode, time.perf_counter() - start)
        return [s for s, t in zip(seqs, token_ids) if t is not None]

    def make_output(self, request_id: str) -> RequestOutput:
        seq, text = self.requests[request_id]
        completion = seq.completion_token_ids
        decoded = self.decode(completion) if seq.is_finished else ""
        output = CompletionOutput(index=0, text=decoded, token_ids=completion, finish_reason=seq.finish_reason)
        return RequestOutput(request_id=request_id, prompt=text, prompt_token_ids=seq.prompt_token_ids,
                             outputs=[output], finished=seq.is_finished)

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def pop_finished(self, request_id: str) -> RequestOutput:
        output = self.make_output(request_id)
        del self.requests[request_id]
        return output

    def close(self) -> None:
        runner = getattr(self, "runner", None)
        if runner is not None and hasattr(runner, "close"):
            runner.close()
