"""Chat conversations to prompt token ids with the tokenizer's own template (no engine needed: the server's front
end renders templates in its own process)."""

from __future__ import annotations


def apply_chat_template(tokenizer, conversation: list[dict], add_generation_prompt: bool = True,
                        chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of ``conversation`` (a list of {"role", "content", ...} dicts) rendered by the model's template."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so it has no chat template.")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template; use generate() with a plain prompt.")
    for message in conversation:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"each chat message must be a dict with 'role' and 'content', got {message!r}.")
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **(chat_template_kwargs or {}))
    return tokenizer.encode(text, add_special_tokens=False)
