"""--reasoning-parser qwen3 on a tiny model whose chat template opens <think> (or closes it, with
enable_thinking false): reasoning_content and content, streamed and not, through the openai client."""

from __future__ import annotations

import pytest

from tests.server.conftest import ENGINE_FLAGS, ServerProcess

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
# the random model writes what this pattern allows: some reasoning, the end of it, an answer
PATTERN = "[a-z]{2,5}</think>[a-z]{2,5}"


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> str:
    from transformers import AutoTokenizer

    from tests.helpers import TINY_COMMON, save_tiny_model
    from tests.server.model import save_tokenizer

    path = str(tmp_path_factory.mktemp("tiny-thinking"))
    save_tiny_model("qwen3", path, seed=0)
    save_tokenizer(path, TINY_COMMON["vocab_size"] - 2)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<think>", "</think>"])  # plain added tokens, as Qwen3's: kept in the text
    assert len(tokenizer) <= TINY_COMMON["vocab_size"]
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def client(thinking_model):
    server = ServerProcess(thinking_model, *ENGINE_FLAGS, "--reasoning-parser", "qwen3")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c
    server.stop()


def ask(client, **kwargs):
    return client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=[{"role": "user", "content": "Hello"}], max_tokens=40,
                                          temperature=1.0, **kwargs)


@pytest.mark.parametrize("seed", [0, 1])
def test_reasoning_is_split_streamed_and_not(client, seed):
    extra = {"structured_outputs": {"regex": PATTERN}}
    message = ask(client, seed=seed, extra_body=extra).choices[0].message
    reasoning, content = message.model_extra["reasoning_content"], message.content
    assert reasoning and content and reasoning.isalpha() and content.isalpha()
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in ask(client, seed=seed, extra_body=extra, stream=True):
        for choice in chunk.choices:
            streamed["content"] += choice.delta.content or ""
            streamed["reasoning_content"] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
    assert streamed == {"reasoning_content": reasoning, "content": content}


def test_enable_thinking_false_reaches_the_template(client):
    extra = {"structured_outputs": {"regex": "[a-z]{2,5}"}, "chat_template_kwargs": {"enable_thinking": False}}
    message = ask(client, seed=0, extra_body=extra).choices[0].message
    assert message.content.isalpha() and message.model_extra.get("reasoning_content") is None


def test_reasoning_answers_match_the_published_schema(client):
    from tests.server.published import PublishedSchema

    schema = PublishedSchema(str(client.base_url).removesuffix("/v1/").removesuffix("/v1"))
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 40, "temperature": 1.0, "seed": 0,
            "structured_outputs": {"regex": PATTERN}}
    answer = schema.post("/v1/chat/completions", "ChatCompletion", body)
    assert answer["choices"][0]["message"]["reasoning_content"]
    events = schema.stream("/v1/chat/completions", "ChatCompletionChunk", body)
    assert any(c["delta"].get("reasoning_content") for e in events for c in e["choices"])
