"""Incremental detokenization and stop strings, on real tokenizers (byte-level BPE and sentencepiece-style)."""

import pytest

from nanovllm.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "héllo wörld, naïve café: 日本語 costs 5€ 🙂 ok",
    "日本語日本語 🙂🙂 end",
    "  leading spaces and\n\nnewlines ###",
]


def metaspace_tokenizer():
    """A sentencepiece-like tokenizer (Llama 2 / Mistral style: "▁" for spaces, byte-fallback tokens <0xNN>),
    where a token's text depends on what precedes it: decoding tokens one at a time would lose spaces."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"] + byte_tokens,
                                  show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog hello world"] * 20, trainer)
    # The trainer registers the byte tokens as special; in sentencepiece models they are ordinary vocabulary.
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in byte_tokens]
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module", params=["byte-level", "metaspace"])
def tokenizer(request, byte_tokenizer):
    return byte_tokenizer if request.param == "byte-level" else metaspace_tokenizer()


def stream(tokenizer, ids, prompt=(), step=1, **kwargs):
    """Feed ids ``step`` at a time; returns the detokenizer and the visible text after each update."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt), **kwargs)
    seen = []
    for i in range(0, len(ids), step):
        detok.update(ids[i:i + step])
        seen.append(detok.output_text(finished=False))
        if detok.stop_string is not None:
            break
    detok.finish()
    return detok, seen


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_incremental_text_equals_full_decode(tokenizer, text, step):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, seen = stream(tokenizer, ids, step=step)
    assert detok.text == tokenizer.decode(ids)
    for before, after in zip(seen, seen[1:] + [detok.text], strict=True):
        assert after.startswith(before), "the text only grows"
    assert all("\ufffd" not in s for s in seen), "an incomplete character is never shown"


def test_multibyte_characters_split_across_tokens_wait_until_whole(byte_tokenizer):
    ids = byte_tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1, "the emoji spans several byte tokens"
    detok = IncrementalDetokenizer(byte_tokenizer, [5])
    for t in ids[:-1]:
        detok.update([t])
        assert detok.text == ""
    detok.update(ids[-1:])
    assert detok.text == "🙂"


def test_first_token_keeps_its_leading_space_after_the_prompt(tokenizer):
    prompt = tokenizer.encode("the quick", add_special_tokens=False)
    ids = tokenizer.encode("the quick brown fox", add_special_tokens=False)[len(prompt):]
    detok, _ = stream(tokenizer, ids, prompt=prompt)
    assert detok.text == " brown fox"


def test_special_tokens_skipped_or_kept(byte_tokenizer):
    ids = byte_tokenizer.encode("hello", add_special_tokens=False) + [byte_tokenizer.eos_token_id]
    assert stream(byte_tokenizer, ids)[0].text == "hello"
    assert stream(byte_tokenizer, ids, skip_special_tokens=False)[0].text == "hello</s>"


def test_truncated_multibyte_output_is_flushed_at_the_end(byte_tokenizer):
    ids = byte_tokenizer.encode("ok 🙂", add_special_tokens=False)[:-1]
    detok, seen = stream(byte_tokenizer, ids)
    assert seen[-1] == "ok "
    assert detok.text == byte_tokenizer.decode(ids) and detok.text.endswith("\ufffd")


# -- stop strings ------------------------------------------------------------------------------------------------
def tokens_of(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("step", [1, 4])
def test_stop_string_is_cut_exactly(tokenizer, step):
    ids = tokens_of(tokenizer, "the quick brown fox jumps over the lazy dog")
    detok, seen = stream(tokenizer, ids, step=step, stop=["jumps", "lazy"])
    assert detok.stop_string == "jumps"
    assert detok.text == "the quick brown fox "
    assert all("jumps" not in s and "jump" not in s for s in seen), "a possible stop string is held back"
    assert detok.text.startswith(seen[-1])


def test_stop_string_spanning_two_tokens(byte_tokenizer):
    ids = tokens_of(byte_tokenizer, "the quick brown fox")
    pieces = [byte_tokenizer.decode(ids[:i + 1]) for i in range(len(ids))]
    # a stop string made of the last char of one token and the first char of the next
    i = next(i for i in range(1, len(ids)) if len(pieces[i]) > len(pieces[i - 1]) and pieces[i - 1])
    stop = pieces[i - 1][-1] + pieces[i][len(pieces[i - 1])]
    full = byte_tokenizer.decode(ids)
    detok, seen = stream(byte_tokenizer, ids, stop=[stop])
    assert detok.stop_string == stop and detok.text == full[:full.index(stop)]
    assert detok.num_tokens == i + 1, "found on the token that completed it"


def test_include_stop_str_in_output_and_earliest_match(tokenizer):
    ids = tokens_of(tokenizer, "the quick brown fox jumps over the lazy dog")
    detok, seen = stream(tokenizer, ids, stop=["lazy", "fox"], include_stop_str_in_output=True)
    assert detok.stop_string == "fox" and detok.text == "the quick brown fox"
    assert seen[0] == detok.text[:len(seen[0])]


def test_hold_back_is_only_a_possible_stop_prefix(byte_tokenizer):
    detok = IncrementalDetokenizer(byte_tokenizer, [5], stop=["STOP!", "xyz"])
    detok.text = "say ST"
    assert detok.output_text(finished=False) == "say "
    detok.text = "say STO p"
    assert detok.output_text(finished=False) == "say STO p"
    assert detok.output_text(finished=True) == "say STO p"
    detok.text = "a x"
    assert detok.output_text(finished=False) == "a "


def test_stop_strings_wait_for_min_tokens(byte_tokenizer):
    ids = tokens_of(byte_tokenizer, "the quick brown fox jumps")
    first = byte_tokenizer.decode(ids[:1])
    detok, _ = stream(byte_tokenizer, ids, stop=[first], min_tokens=1)
    assert detok.stop_string is None, "the only match is within the first min_tokens tokens"
    detok, _ = stream(byte_tokenizer, ids, stop=[first])
    assert detok.stop_string == first and detok.text == ""
