"""The sampler on a CUDA device: no host sync before the token ids are read, seeded rows, filtered mass."""

import numpy as np
import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.engine.sampling import build_sampling_tensors
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import Sampler
from tests.sampling.test_sampler import LOGITS, PROBS, SETTINGS, reference_distribution, tile

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def seqs_for(params_list, output=(3, 3, 4)):
    seqs = []
    for p in params_list:
        seq = Sequence([1, 2, 3], p)
        for t in output:
            seq.append_token(t)
        seq.extras.min_tokens_stop_ids = (0,)
        seqs.append(seq)
    return seqs


def test_no_host_sync_until_the_tokens_are_read():
    params = [SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, seed=1, logprobs=5),
              SamplingParams(temperature=0), SamplingParams(repetition_penalty=1.3, presence_penalty=0.5,
                                                            frequency_penalty=0.5, min_tokens=8),
              SamplingParams(temperature=1.2, top_k=3), SamplingParams(seed=5, top_p=0.5)]
    seqs = seqs_for(params)
    logits = torch.randn(len(seqs), 32000, device=CUDA)
    generator = torch.Generator(device=CUDA).manual_seed(0)
    build_sampling_tensors(seqs, 32000, CUDA)  # warm-up: creates the seeded generators
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tensors = build_sampling_tensors(seqs, 32000, CUDA)
        out = Sampler()(logits, tensors, generator)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens = out.token_ids.tolist()
    assert tokens[1] == int(logits[1].argmax())
    assert out.logprobs.top_ids.shape == (1, 5)


def test_seeded_rows_and_filtered_mass_on_cuda():
    draws = 20_000
    tensors = build_sampling_tensors(seqs_for(SETTINGS, output=()), len(PROBS), CUDA)
    logits = LOGITS.to(CUDA).repeat(len(SETTINGS) * draws, 1)
    tokens = Sampler()(logits, tile(tensors, draws), torch.Generator(device=CUDA).manual_seed(0)).token_ids
    tokens = tokens.view(draws, len(SETTINGS)).cpu()
    for row, p in enumerate(SETTINGS):
        expected = reference_distribution(LOGITS, p)
        counts = np.bincount(tokens[:, row].numpy(), minlength=len(PROBS))
        assert (counts[expected == 0] == 0).all(), p
        assert np.abs(counts / draws - expected).max() < 0.02, (p, counts / draws, expected)

    vocab = 1000
    row = torch.randn(vocab, device=CUDA)
    seeded = SamplingParams(seed=99)

    def draw(others):
        seqs = seqs_for([seeded] + others, output=())
        logits = torch.randn(len(seqs), vocab, device=CUDA)
        logits[0] = row
        return int(Sampler()(logits, build_sampling_tensors(seqs, vocab, CUDA),
                             torch.Generator(device=CUDA).manual_seed(len(others))).token_ids[0])

    assert draw([]) == draw([SamplingParams(top_p=0.3), SamplingParams(seed=4), SamplingParams(temperature=0)])
