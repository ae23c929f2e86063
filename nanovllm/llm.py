"""The offline API: LLM(model).generate(prompts, params) and .chat(messages), shaped like vLLM's."""

from __future__ import annotations

from tqdm.auto import tqdm

from nanovllm.engine.llm_engine import LLMEngine, Prompt
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams


class LLM(LLMEngine):
    """An engine for offline batches. ``LLM()`` with no model runs the embedded SmolLM2-135M-Instruct."""

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
                    request_id = seq.request_id
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
                    bar.set_postfix_str(f"prefill {prefill_rate:,.0f} tok/s, decode {decode_rate:,.0f} tok/s")
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

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template.")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; use generate() with a plain prompt.")
        for message in conversation:
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"each chat message must be a dict with 'role' and 'content', got {message!r}.")
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **(chat_template_kwargs or {}))
        return self.tokenizer.encode(text, add_special_tokens=False)

    def get_tokenizer(self):
        return self.tokenizer
