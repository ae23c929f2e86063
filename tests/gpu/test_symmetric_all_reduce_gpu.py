"""The peer-to-peer all-reduce of small tensors gives NCCL's sums, eagerly and replayed in a CUDA graph."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

SHAPES = [(1, 4096), (7, 1024), (256, 4096)]  # and the largest the 8 MiB buffer takes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int) -> None:
    from nanovllm.distributed.symmetric_all_reduce import SymmetricAllReduce

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    try:
        reducer = SymmetricAllReduce.create(device)
        assert reducer is not None, "symmetric memory unavailable on this host"
        g = torch.Generator(device=device).manual_seed(rank)
        for dtype in (torch.bfloat16, torch.float32):
            for shape in SHAPES + [((8 << 20) // (4096 * dtype.itemsize), 4096)]:
                x = torch.randn(shape, generator=g, device=device).to(dtype)
                expected = x.clone()
                dist.all_reduce(expected)
                assert reducer.handles(x)
                assert reducer(x) is x
                torch.testing.assert_close(x, expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-2)

        # a partial sum computed straight into the shared buffer (the row-parallel layers' path)
        x = torch.randn(8, 1024, generator=g, device=device).to(torch.bfloat16)
        expected = x.clone()
        dist.all_reduce(expected)
        shared = reducer.shared_output(x.shape, x.dtype)
        shared.copy_(x)
        torch.testing.assert_close(reducer.reduce_shared(shared), expected, rtol=1e-2, atol=1e-2)
        assert reducer.shared_output((4096, 4096), torch.bfloat16) is None

        # inside a CUDA graph: new inputs copied into the captured tensor, then replayed
        static = torch.zeros(64, 4096, dtype=torch.bfloat16, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            reducer(static.clone())  # warm-up outside capture
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = reducer(static) * 1  # a consumer after the reduction, as the residual add is
        for _ in range(3):
            fresh = torch.randn(static.shape, generator=g, device=device).to(static.dtype)
            expected = fresh.clone()
            dist.all_reduce(expected)
            static.copy_(fresh)
            graph.replay()
            torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)

        too_big = torch.empty(4096, 4096, dtype=torch.bfloat16, device=device)  # 32 MiB > the 8 MiB buffer
        assert not reducer.handles(too_big)
        assert not reducer.handles(torch.empty(3, 5, dtype=torch.bfloat16, device=device))  # not 16-element shares
        assert not reducer.handles(torch.empty(64, 64, dtype=torch.float16, device=device))  # not supported
        torch.cuda.synchronize(device)
        dist.barrier()
        reducer.close()
    finally:
        dist.destroy_process_group()


def test_symmetric_all_reduce_matches_nccl():
    mp.spawn(_rank_main, args=(2, _free_port()), nprocs=2, join=True)
