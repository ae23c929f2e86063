"""The L2 prefetch of a layer's later weights (kernels/l2_prefetch.py): its plans on any machine, its kernel and the
engine with it on a Hopper GPU (the bulk prefetch instruction is sm_90's; the compile test builds it for sm_90)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from nanovllm.kernels import l2_prefetch  # noqa: E402
from nanovllm.kernels.l2_prefetch import LANES, MIN_CHUNK_BYTES, prefetch_plan  # noqa: E402


def test_a_plan_covers_each_tensor_once_in_order_in_chunks_of_16_byte_multiples():
    tensors = [torch.empty(1000, 24, dtype=torch.bfloat16), torch.empty(3, 16, dtype=torch.float8_e4m3fn),
               torch.empty(5000, 8, dtype=torch.float32)]
    plan = prefetch_plan(tensors, programs=4)
    addresses, sizes = plan.chunks.tolist()
    assert all(size % 16 == 0 and 0 < size <= max(sizes) for size in sizes)
    assert max(sizes) >= MIN_CHUNK_BYTES
    position = 0
    for t in tensors:  # each tensor's chunks follow one another and end at its last byte
        start, nbytes = t.data_ptr(), t.numel() * t.element_size()
        assert addresses[position] == start
        covered = 0
        while covered < nbytes:
            assert addresses[position] == start + covered
            covered += sizes[position]
            position += 1
        assert covered == nbytes
    assert position == len(addresses)
    assert plan.tensors == tuple(tensors)


def test_a_large_plan_has_about_one_chunk_per_lane_of_its_programs():
    weight = torch.empty(64 * 2 ** 20, dtype=torch.uint8)
    plan = prefetch_plan([weight], programs=132)
    chunks = plan.chunks.shape[1]
    assert 132 * LANES * 0.9 <= chunks <= 132 * LANES


def test_a_plan_refuses_a_tensor_the_instruction_cannot_take():
    with pytest.raises(AssertionError, match="multiple of 16"):
        prefetch_plan([torch.empty(7, dtype=torch.uint8)], programs=1)
    with pytest.raises(AssertionError, match="contiguous"):
        prefetch_plan([torch.empty(64, 64)[:, :8]], programs=1)


def test_each_decoder_layer_plans_its_later_weights_within_the_budget():
    """o_proj's weight, then a dense MLP's gate_up_proj's and down_proj's, whole ones while they fit; an MoE layer
    plans o_proj alone; an fp8 layer plans the e4m3 copy it reads."""
    from nanovllm.layers.quantization.fp8 import quantize_linear_layers
    from nanovllm.models import model_class
    from nanovllm.models.decoder import DecoderMLP, prefetch_weights_after_attention
    from tests.helpers import tiny_config
    config = tiny_config("qwen3_moe")  # layer 1 dense, layers 0, 2 and 3 sparse
    model = model_class(config)(config, 128)
    layers = model.model.layers
    dense = layers[1]
    o, gate_up, down = dense.self_attn.o_proj.weight, dense.mlp.gate_up_proj.weight, dense.mlp.down_proj.weight
    nbytes = [w.numel() * w.element_size() for w in (o, gate_up, down)]

    assert prefetch_weights_after_attention(model, tuple, budget_bytes=sum(nbytes)) == len(layers)
    for layer in layers:
        plan = layer.self_attn.attn.weight_prefetch
        assert plan[0] is layer.self_attn.o_proj.weight
        if isinstance(layer.mlp, DecoderMLP):
            assert plan[1:] == (layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight)
        else:
            assert len(plan) == 1
    prefetch_weights_after_attention(model, tuple, budget_bytes=sum(nbytes) - 1)
    assert dense.self_attn.attn.weight_prefetch == (o, gate_up)  # down no longer fits whole
    assert prefetch_weights_after_attention(model, tuple, budget_bytes=nbytes[0] - 1) == 0

    quantize_linear_layers(model)
    prefetch_weights_after_attention(model, tuple, budget_bytes=sum(nbytes))
    plan = dense.self_attn.attn.weight_prefetch
    assert [w.dtype for w in plan] == [torch.float8_e4m3fn] * 3
    assert plan[0] is dense.self_attn.o_proj.linear_method.weight


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper GPU")
def test_gpu_prefetch_in_a_graph_leaves_every_value_as_it_was():
    weights = [torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    plan = l2_prefetch.plan_for_device(weights)
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    expected = [x @ w.t() for w in weights]
    graph = torch.cuda.CUDAGraph()
    outs = []
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        l2_prefetch.l2_prefetch(plan)  # warm the compile outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        l2_prefetch.l2_prefetch(plan)
        outs = [x @ w.t() for w in weights]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for out, want in zip(outs, expected):
        torch.testing.assert_close(out, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper GPU")
def test_gpu_engine_gives_the_same_tokens_with_the_prefetch(monkeypatch):
    """The Qwen3-0.6B shape in bf16 with CUDA graphs: decode steps of up to 16 requests launch the prefetch before
    each layer's attention; the greedy tokens equal those without it."""
    import gc
    from pathlib import Path

    from nanovllm import LLM, SamplingParams
    from nanovllm.attention.triton_backend import TritonAttentionBackend
    folder = Path(__file__).resolve().parents[2] / "benchmarks" / "model_configs" / "qwen3-0.6b"
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 10000, (n,), generator=g).tolist() for n in (3, 40, 200, 700, 1500, 9, 64, 300)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    launches = []
    launch = l2_prefetch.l2_prefetch
    monkeypatch.setattr(l2_prefetch, "l2_prefetch", lambda plan: launches.append(plan) or launch(plan))
    tokens = {}
    for rows in (0, 16):
        monkeypatch.setattr(TritonAttentionBackend, "prefetch_weights_up_to", rows)
        llm = LLM(str(folder), load_format="dummy", max_model_len=2048, max_num_seqs=16, num_kvcache_blocks=64)
        layers = getattr(llm.runner, "runner", llm.runner).model.attention_layers()
        assert all(layer.weight_prefetch is not None for layer in layers)
        tokens[rows] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert bool(launches) == bool(rows)  # captured into the decode graphs (once a layer per graph)
        llm.close()
        del llm, layers
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens[16] == tokens[0]
