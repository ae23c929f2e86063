"""The row-scale plan of cpu_int8's fbgemm steps: rows handed between ops as values and a scale apart.

fbgemm's int8 linear takes one activation scale for a whole tensor, so each row is normalized to a largest
magnitude of 1 first and its product multiplied back (platforms/cpu/linear.int8_linear). The norms and the
activation that feed such a linear can write their rows normalized, and o_proj, gate_up_proj and down_proj can
leave their row scale to the op after them (model.plan_row_scales decides, once, where): six passes
over a tensor fewer per layer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nanovllm.platforms.cpu import cpu_ops


class RowScaled(NamedTuple):
    """Rows given as ``values * scale`` (scale [rows, 1]), under ``cpu_int8``: what an int8 linear reads (values
    normalized to a largest magnitude of 1 by the norm or activation that wrote them) and what it returns when the
    op after it applies the scale itself (see int8_linear). Each saves a pass over the tensor."""

    values: torch.Tensor
    scale: torch.Tensor

    def materialize(self) -> torch.Tensor:
        return self.values * self.scale


def fbgemm_takes(rows: int) -> bool:
    """Whether an int8 step of this many rows multiplies through a kernel for many rows (fbgemm's int8_linear or
    the compiled tiles, both of which read RowScaled); fewer rows take the compiled matrix-vector kernel, which
    reads plain rows."""
    return rows > cpu_ops.LINEAR_I8_MAX_ROWS


def normalize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / m, m), m each row's largest magnitude ([..., 1]; 1 for a row of zeros)."""
    if x.dim() == 2 and x.is_contiguous() and cpu_ops.usable(x):
        return cpu_ops.normalize_rows(x)  # one pass instead of four torch ops
    row_max = x.abs().amax(dim=-1, keepdim=True)
    row_max = torch.where(row_max > 0, row_max, torch.ones_like(row_max))
    return x / row_max, row_max
