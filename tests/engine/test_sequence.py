import pickle

import pytest

from nanovllm import SamplingParams
from nanovllm.engine.sequence import Sequence, SequenceExtras, SequenceStatus


@pytest.fixture(autouse=True)
def block_size_256():
    old = Sequence.block_size
    Sequence.block_size = 256
    yield
    Sequence.block_size = old


def test_seed_block_arithmetic():
    assert Sequence(list(range(256))).num_blocks == 1
    seq = Sequence(list(range(257)))
    assert seq.num_blocks == 2
    assert seq.last_block_num_tokens == 1
    assert seq.block(1) == [256]
    with pytest.raises(AssertionError):
        seq.block(2)


def test_fields_and_append():
    prompt = [1, 2, 3]
    seq = Sequence(prompt, SamplingParams(temperature=0.5, max_tokens=7, ignore_eos=True))
    assert seq.status == SequenceStatus.WAITING and not seq.is_finished
    assert (seq.temperature, seq.max_tokens, seq.ignore_eos) == (0.5, 7, True)
    assert seq.num_cached_tokens == 0 and seq.num_scheduled_tokens == 0 and seq.is_prefill
    seq.append_token(9)
    assert prompt == [1, 2, 3], "the caller's list must not change"
    assert len(seq) == 4 and seq.last_token == 9 and seq[1:3] == [2, 3]
    assert seq.prompt_token_ids == [1, 2, 3] and seq.completion_token_ids == [9]
    assert seq.num_completion_tokens == 1 and seq.num_prompt_tokens == 3


def test_ids_increase():
    a, b = Sequence([1]), Sequence([1])
    assert b.seq_id > a.seq_id


def test_pickle_ships_tokens_only_in_prefill():
    seq = Sequence(list(range(10)))
    seq.block_table = [3]
    seq.num_cached_tokens, seq.num_scheduled_tokens = 4, 6
    copy = pickle.loads(pickle.dumps(seq))
    assert copy.token_ids == list(range(10)) and copy.last_token == 9 and copy.is_prefill
    assert (copy.num_tokens, copy.num_prompt_tokens, copy.num_cached_tokens, copy.num_scheduled_tokens,
            copy.block_table) == (10, 10, 4, 6, [3])
    seq.append_token(42)
    seq.is_prefill = False
    state = seq.__getstate__()
    assert state[6] == 42, "decode ships only the last token (after the step's draft tokens)"
    copy = pickle.loads(pickle.dumps(seq))
    assert copy.token_ids == [] and copy.last_token == 42 and not copy.is_prefill and copy.num_tokens == 11


def test_extras_are_one_object_that_stays_in_the_engine_process():
    extras = SequenceExtras(request_id="r", index=1, needs_prompt_logprobs=True, min_tokens_stop_ids=(2,))
    seq = Sequence(list(range(5)), extras=extras)
    assert seq.extras is extras
    assert Sequence([1]).extras is not Sequence([1]).extras, "each sequence gets its own by default"
    with pytest.raises(AttributeError):
        extras.request = "r"  # slots: a misspelt field is an error, not a new attribute
    state = seq.__getstate__()
    assert not any(isinstance(item, SequenceExtras) or item == "r" for item in state)
    copy = pickle.loads(pickle.dumps(seq))
    assert not hasattr(copy, "extras") and not hasattr(copy, "sampling_params")
