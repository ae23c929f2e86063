"""The offline API: LLM(model).generate(prompts, params) and .chat(messages), shaped like vLLM's."""

from __future__ import annotations

import weakref

from tqdm.auto import tqdm

from nanovllm.engine.llm_engine import LLMEngine, Prompt
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams


class _engine_attribute:  # lower case, as property
    """The engine's attribute of that name, read through (a bound method for a method): LLM's thin delegation.
    Only ``__get__``: an instance may still set its own (tests and benchmarks wrap ``step`` this way)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, llm, owner=None):
        if llm is None:
            return self
        return getattr(llm.llm_engine, self.name)


class LLM:
    """An engine for offline batches. ``LLM()`` with no model runs the embedded SmolLM2-135M-Instruct.

    It holds its ``LLMEngine`` (``llm_engine``) and releases it on ``close()``, at the end of a ``with`` block,
    or once it is garbage: tensor-parallel workers exit then, and a later engine in the process starts clean.
    """

    def __init__(self, model: str | None = None, **engine_args):
        self.llm_engine = LLMEngine(model, **engine_args)
        # holds the engine, not self: runs once, on close(), when the LLM is collected, or at interpreter exit
        self._finalizer = weakref.finalize(self, self.llm_engine.close)

    def close(self) -> None:
        """Release the engine: its KV pool, its CUDA graphs, its tensor-parallel workers (idempotent)."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # the engine's request-level interface, for callers that step it themselves (AsyncLLM, the server, tests)
    add_request = _engine_attribute("add_request")
    abort_request = _engine_attribute("abort_request")
    step = _engine_attribute("step")
    has_unfinished_requests = _engine_attribute("has_unfinished_requests")
    is_request_finished = _engine_attribute("is_request_finished")
    make_output = _engine_attribute("make_output")
    pop_finished = _engine_attribute("pop_finished")
    forget_request = _engine_attribute("forget_request")
    request_error = _engine_attribute("request_error")
    reset_prefix_cache = _engine_attribute("reset_prefix_cache")
    tokenize_prompt = _engine_attribute("tokenize_prompt")
    validate_request = _engine_attribute("validate_request")
    check_structured_outputs = _engine_attribute("check_structured_outputs")
    apply_chat_template = _engine_attribute("apply_chat_template")
    stop_sample = _engine_attribute("stop_sample")
    decode = _engine_attribute("decode")
    # what the engine is and holds
    config = _engine_attribute("config")
    tokenizer = _engine_attribute("tokenizer")
    hf_config = _engine_attribute("hf_config")
    model_path = _engine_attribute("model_path")
    eos_token_ids = _engine_attribute("eos_token_ids")
    vocab_size = _engine_attribute("vocab_size")
    max_model_len = _engine_attribute("max_model_len")
    input_processor = _engine_attribute("input_processor")
    request_limits = _engine_attribute("request_limits")
    num_kvcache_blocks = _engine_attribute("num_kvcache_blocks")
    last_step = _engine_attribute("last_step")
    requests = _engine_attribute("requests")
    async_scheduling = _engine_attribute("async_scheduling")
    # its parts, for tests and benchmarks
    scheduler = _engine_attribute("scheduler")
    runner = _engine_attribute("runner")

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; results in input order, one RequestOutput per prompt (with
        ``outputs[0..n-1]`` for SamplingParams.n samples).

        prompts: a string, a list of token ids, or a list of either (or of {"prompt_token_ids": [...]}).
        sampling_params: one for all prompts, or one per prompt.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts; "
                                 "give one, or one per prompt.")
            params = sampling_params
        else:
            params = [sampling_params if sampling_params is not None else SamplingParams()] * len(prompts)
        # Check everything before queueing anything, so a bad prompt leaves the engine untouched.
        for prompt, p in zip(prompts, params):
            _, token_ids = self.tokenize_prompt(prompt)
            self.validate_request(token_ids, p)

        request_ids = [self.add_request(prompt, p) for prompt, p in zip(prompts, params)]
        pending = set(request_ids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        prefill_rate = decode_rate = 0.0
        try:
            while pending:
                for seq in self.step():
                    request_id = seq.extras.request_id
                    if seq.is_finished and request_id in pending and self.is_request_finished(request_id):
                        pending.discard(request_id)
                        results[request_id] = self.pop_finished(request_id)
                        bar.update(1)
                stats = self.last_step
                if stats.seconds > 0:
                    if stats.prefill_tokens:
                        prefill_rate = stats.prefill_tokens / stats.seconds
                    if stats.decode_tokens and not stats.prefill_tokens:
                        decode_rate = stats.decode_tokens / stats.seconds
                    postfix = f"prefill {prefill_rate:,.0f} tok/s, decode {decode_rate:,.0f} tok/s"
                    spec = self.scheduler.spec_stats
                    if spec.num_drafts:
                        postfix += f", accept len {spec.mean_acceptance_length:.2f}"
                    bar.set_postfix_str(postfix)
        finally:
            bar.close()
            for request_id in pending:  # interrupted: leave no request behind holding blocks
                self.abort_request(request_id)
        return [results[r] for r in request_ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation or to each of a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt, chat_template_kwargs)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_tokenizer(self):
        return self.tokenizer
