"""NANOVLLM_NO_COMPILE is read once, into the engine config, and the layers built for that engine take their ops'
eager form: no layer reads the environment when it runs."""

import pytest
import torch

from nanovllm.config import EngineConfig
from nanovllm.layers.activation import SiluAndMul, silu_and_mul
from nanovllm.layers.compile import building_compiled
from nanovllm.layers.norm import RMSNorm, add_rms_norm, rms_norm
from nanovllm.layers.rotary import RotaryEmbedding, apply_rotary


class _RopeConfig:
    rope_theta = 10000.0


def _layers():
    return RMSNorm(8), SiluAndMul(), RotaryEmbedding(_RopeConfig(), 8, 16)


def test_the_config_reads_the_environment_once(monkeypatch):
    monkeypatch.delenv("NANOVLLM_NO_COMPILE", raising=False)
    assert EngineConfig(device="cpu").compile_small_ops
    monkeypatch.setenv("NANOVLLM_NO_COMPILE", "1")
    config = EngineConfig(device="cpu")
    assert not config.compile_small_ops
    monkeypatch.delenv("NANOVLLM_NO_COMPILE")
    assert not config.compile_small_ops, "an engine's choice does not follow later changes of the environment"


def test_layers_take_the_eager_ops_when_built_without_compiling():
    norm, act, rope = _layers()  # outside any engine: the compiled-on-CUDA wrappers, as before
    assert (norm._rms_norm, norm._add_rms_norm, act._silu_and_mul, rope._apply_rotary) == \
        (rms_norm, add_rms_norm, silu_and_mul, apply_rotary)
    with building_compiled(False):
        norm, act, rope = _layers()
    assert (norm._rms_norm, norm._add_rms_norm, act._silu_and_mul, rope._apply_rotary) == \
        (rms_norm.__wrapped__, add_rms_norm.__wrapped__, silu_and_mul.__wrapped__, apply_rotary.__wrapped__)
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), rms_norm(x, norm.weight, norm.eps))
    torch.testing.assert_close(act(x), silu_and_mul(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_eager_layers_never_compile_on_cuda(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile was called for a layer built without compiling")

    monkeypatch.setattr(torch, "compile", refuse)
    with torch.device("cuda"), building_compiled(False):
        norm, act, _ = _layers()
    x = torch.randn(3, 8, device="cuda")
    torch.testing.assert_close(norm(x, x)[0], add_rms_norm.__wrapped__(x, x, norm.weight, norm.eps)[0])
    torch.testing.assert_close(act(x), silu_and_mul.__wrapped__(x))
