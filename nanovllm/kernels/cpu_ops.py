"""The CPU's compiled ops live in nanovllm/platforms/cpu/cpu_ops.py; this name stays one module with it (the same
object, so a patched attribute is seen through either name) until the attention backends move there too."""

import sys

from nanovllm.platforms.cpu import cpu_ops

sys.modules[__name__] = cpu_ops
