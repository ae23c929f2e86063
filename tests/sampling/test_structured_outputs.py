"""Structured outputs, logit_bias, allowed_token_ids and bad_words in the engine, on a tiny random model: a
random model's output must still fit the constraint, every time."""

from __future__ import annotations

import json
import re

import pytest
import torch

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.engine.sampling import bad_word_tokens, token_bitmask
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import apply_token_bitmask
from tests.engine.test_async_scheduling import BLOCK, assert_all_free

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {
    "word": {"type": "string", "enum": ["fox", "dog", "café"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "items": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    "inner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"],
              "additionalProperties": False}},
    "required": ["word", "count", "items", "inner"], "additionalProperties": False}
BASE = dict(kvcache_block_size=BLOCK, num_kvcache_blocks=128, max_model_len=256)


@pytest.fixture(scope="module")
def llm(tiny_text_model):
    return LLM(tiny_text_model, async_scheduling=False, **BASE)


def test_json_schema_regex_choice_fit_every_time(llm):
    constraints = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(json_object=True),
                   StructuredOutputsParams(regex="(fox|dog) [0-9]{1,3}!"), StructuredOutputsParams(choice=["a", "bc"]),
                   StructuredOutputsParams(grammar='root ::= "the " ("fox" | "dog")')]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=120, structured_outputs=c)
              for c in constraints for seed in range(3)]
    outputs = llm.generate(["the quick brown"] * len(params), params, use_tqdm=False)
    for p, output in zip(params, outputs, strict=True):
        c, text = p.structured_outputs, output.outputs[0].text
        if c.json_object and output.outputs[0].finish_reason == "length":
            assert text.startswith('{"'), text  # any object: a random model may not close it in time
            continue
        assert output.outputs[0].finish_reason == "stop", (c, text)
        if c.json is not None:
            jsonschema.validate(json.loads(text), SCHEMA)
        elif c.json_object:
            assert isinstance(json.loads(text), dict)
        elif c.regex is not None:
            assert re.fullmatch(c.regex, text), text
        elif c.choice is not None:
            assert text in c.choice
        else:
            assert text in ("the fox", "the dog")
    unconstrained = llm.generate(["the quick brown"], SamplingParams(temperature=1.0, seed=0, max_tokens=20),
                                 use_tqdm=False)[0].outputs[0].text
    with pytest.raises(ValueError):
        json.loads(unconstrained)  # the random model alone writes no JSON: the grammar did it


def test_constrained_requests_in_an_asynchronously_scheduled_batch(tiny_text_model, llm):
    """A constrained request is never in a step planned ahead (its mask needs the token in flight), and its
    tokens, and its neighbours', are those of synchronous scheduling."""
    ahead = LLM(tiny_text_model, async_scheduling=True, **BASE)
    planned = []
    original = ahead.scheduler.schedule_ahead

    def spy(in_flight):
        seqs = original(in_flight)
        planned.extend(s.extras.grammar is not None for s in seqs)
        return seqs

    ahead.scheduler.schedule_ahead = spy
    prompts = ["the quick brown fox", "hello world and", "café naïve"]
    # the neighbours outlive the constrained request (its JSON ends within its 150 tokens; 68 here): the steps
    # after it are planned ahead whatever the grammar's compile time, which alone decided it with 40 tokens
    params = [SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=1, max_tokens=150, structured_outputs={"json": SCHEMA}),
              SamplingParams(temperature=0.8, seed=2, max_tokens=200, ignore_eos=True)]
    expected = llm.generate(prompts, params, use_tqdm=False)
    got = ahead.generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, expected, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    jsonschema.validate(json.loads(got[1].outputs[0].text), SCHEMA)
    assert len(got[1].outputs[0].token_ids) < 200
    assert planned and not any(planned), "steps were planned ahead once the constrained request had finished"
    assert_all_free(ahead)


def test_logit_bias_allowed_token_ids_and_bad_words(llm):
    prompt = ["the quick brown fox"]
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0].token_ids
    biased = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, logit_bias={greedy[0]: -100}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert biased[0] != greedy[0]
    forced = llm.generate(prompt, SamplingParams(temperature=0.9, seed=0, max_tokens=4, logit_bias={"77": 100}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert forced == [77] * 4
    allowed = llm.generate(prompt, SamplingParams(temperature=1.0, seed=0, max_tokens=12, ignore_eos=True,
                                                  allowed_token_ids=[40, 50, 60]), use_tqdm=False)
    assert set(allowed[0].outputs[0].token_ids) <= {40, 50, 60}
    word = llm.tokenizer.decode(greedy[:1])
    assert llm.tokenizer.encode(word.strip()) == greedy[:1] or llm.tokenizer.encode(" " + word.strip()) == greedy[:1]
    banned = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, bad_words=[word]),
                          use_tqdm=False)[0].outputs[0]
    assert banned.token_ids[0] != greedy[0]
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(prompt, SamplingParams(logit_bias={10_000: 1.0}), use_tqdm=False)


def test_bitmask_of_allowed_token_ids_and_its_application():
    vocab = 70
    seq = Sequence([1, 2], SamplingParams(allowed_token_ids=[0, 31, 32, 69]))
    bitmask = token_bitmask([seq], vocab)
    assert bitmask.shape == (1, 3) and bitmask.dtype == torch.int32
    logits = torch.randn(3, vocab)
    masked = apply_token_bitmask(logits, torch.tensor([1]), bitmask)
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    assert allowed == [0, 31, 32, 69]
    assert torch.equal(masked[[0, 2]], logits[[0, 2]]) and torch.equal(masked[1, allowed], logits[1, allowed])


def test_bad_words_ban_the_last_token_after_the_others():
    seq = Sequence([9, 9], SamplingParams(bad_words=["x"]))
    seq.extras.bad_words_token_ids = ((5,), (6, 7), (6, 8, 3))
    assert bad_word_tokens(seq) == [5]  # nothing generated yet: only the one-token word
    seq.append_token(6)
    assert bad_word_tokens(seq) == [5, 7]
    seq.append_token(8)
    assert bad_word_tokens(seq) == [5, 3]


@pytest.mark.parametrize("kwargs, words", [
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "exactly one"),
    (dict(structured_outputs={"json": "{not json"}), "not valid JSON"),
    (dict(structured_outputs={"choice": []}), "choice"),
    (dict(structured_outputs={"jsn": {}}), "unknown field"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={3: 101}), r"\[-100, 100\]"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
])
def test_sampling_params_refuse_bad_values(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_a_schema_that_cannot_compile_fails_the_request_alone(llm):
    with pytest.raises(ValueError, match="Unsupported type"):
        llm.check_structured_outputs(StructuredOutputsParams(json={"type": "nonsense"}))
    bad = llm.add_request("the fox", SamplingParams(max_tokens=4, structured_outputs={"json": {"type": "other"}}))
    good = llm.add_request("the fox", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while llm.has_unfinished_requests():
        llm.step()
    assert "Unsupported type" in llm.request_error(bad)
    assert llm.pop_finished(bad).outputs[0].finish_reason == "error"
    assert llm.pop_finished(good).outputs[0].finish_reason == "length"
    assert_all_free(llm)


def test_json_strings_refuse_raw_control_characters(byte_tokenizer):
    """JSON forbids raw U+0000..U+001F in strings, bounded in length or not (xgrammar 0.2 lets bounded ones
    take them; the backend corrects its grammar)."""
    from nanovllm.structured_outputs import GrammarBackend

    backend = GrammarBackend(byte_tokenizer, 384, [2])
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 4}, "b": {"type": "string"}}}
    for text, fits in [('{"a": "x\x15', False), ('{"b": "x\x01', False), ('{"a": "xé", "b": "y\\n"}', True)]:
        grammar = backend.request_grammar(StructuredOutputsParams(json=schema))
        assert grammar.matcher.accept_string(text) == fits, text
