"""The token counts that get piecewise CUDA graphs (their replay is tested on a GPU: tests/gpu)."""

from nanovllm.config import EngineConfig
from nanovllm.engine.piecewise_graphs import MAX_PIECEWISE_TOKENS, token_ladder


def test_the_ladder_pads_a_step_by_less_than_half_in_sixteens_and_ends_at_the_budget():
    sizes = token_ladder(MAX_PIECEWISE_TOKENS)
    assert sizes[0] == 16 and sizes[-1] == MAX_PIECEWISE_TOKENS
    assert sizes == sorted(set(sizes))
    for n in range(17, MAX_PIECEWISE_TOKENS + 1):
        size = next(s for s in sizes if s >= n)
        assert size % 16 == 0 and (size < 1.5 * n or size == 32), (n, size)
    assert token_ladder(100) == [16, 32, 48, 64, 96, 100]
    assert token_ladder(10) == [10]


def test_graph_modes_follow_vllm_and_enforce_eager_turns_every_graph_off():
    def modes(**kwargs):
        config = EngineConfig(device="cpu", **kwargs)
        config.device = "cuda"  # the properties only; nothing is built
        return config.full_decode_graphs, config.piecewise_graphs

    assert modes() == (True, True)
    assert modes(cudagraph_mode="full_decode_only") == (True, False)
    assert modes(cudagraph_mode="piecewise") == (False, True)
    assert modes(cudagraph_mode="none") == (False, False)
    assert modes(enforce_eager=True) == (False, False)
    assert EngineConfig(device="cpu").piecewise_graphs is False
