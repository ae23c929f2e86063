import pytest

from nanovllm.engine.sequence import Sequence


@pytest.fixture
def sequence_block_size(request):
    """Set the class-wide Sequence.block_size for one test (a module sets BLOCK and uses this autouse)."""
    old = Sequence.block_size
    Sequence.block_size = request.module.BLOCK
    yield request.module.BLOCK
    Sequence.block_size = old
