"""Sum of per-program partial results over their leading axis: ``out = part.sum(0)``, cast to a dtype.

Our backward kernels leave column sums (the bias gradient) and split-M weight gradients as fp32 partials
[P, ...], one row per program, so no element is written by two programs (no atomics, the same result run
to run). ``torch.sum(dim=0)`` on such a short, wide tensor picks a slow reduction on the GPU, which can
take longer than the layer's GEMMs; this kernel reads it once, one program per 32 columns. A loop over
many partial rows is latency-bound, hence ``MAX_PARTIAL_ROWS`` for the kernels that write them.

Shapes: part [P, ...] fp32 (contiguous), P >= 1; out part.shape[1:] in ``dtype``. Summation in fp32, rows
in order 0..P-1 (blocks of BLOCK_P rows summed then added), so the result does not depend on the run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.launch import use_triton

__all__ = ["MAX_PARTIAL_ROWS", "row_programs", "sum_partials"]

# Kernels that leave column-sum partials run at most this many programs along M (times a kernel's `scale`,
# ``row_programs``), each looping over every P-th row block, so the partials stay short: one loop step
# here.
MAX_PARTIAL_ROWS = 128
# A loop step sums a [_BLOCK_P, _BLOCK_N] block, 8 warps to a program: the partials of the dx GEMM with
# act' (``kernels.gemm.dx_act``) run to cdiv(M, 64) rows, so a program's loop is a chain of dependent loads
# as long as P / _BLOCK_P, few programs to a layer's width.
_BLOCK_P = 256
_BLOCK_N = 32
_WARPS = 8


def row_programs(m: int, block_m: int, scale: int = 1) -> int:
    """Programs along M for a row-block loop over M rows: min(row blocks, scale * MAX_PARTIAL_ROWS), >= 1.

    A kernel whose grid has few programs across (a whole row per program, or few column tiles) takes a
    scale > 1, so its grid still fills the GPU; the partials it leaves grow with it, and so does the time
    to sum them."""
    return max(1, min(triton.cdiv(m, block_m), scale * MAX_PARTIAL_ROWS))


@triton.jit(do_not_specialize=["P", "N"])
def _sum_partials_kernel(part_ptr, out_ptr, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < N
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for start in range(0, P, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P).to(tl.int64)
        mask = (rows < P)[:, None] & mask_n[None, :]
        acc += tl.load(part_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=mask_n)


def sum_partials(part: Tensor, dtype: torch.dtype) -> Tensor:
    """``part.sum(dim=0).to(dtype)`` for fp32 partials [P, ...] (module docstring).

    Raises:
        ValueError: part not fp32, not contiguous, or with no leading axis.
    """
    if part.dtype != torch.float32 or not part.is_contiguous() or part.ndim < 1:
        shape = list(part.shape)
        raise ValueError(f"sum_partials: expected contiguous fp32 [P, ...], got {part.dtype} {shape}")
    if not use_triton(part) or part.shape[0] == 0:
        return part.sum(dim=0).to(dtype)
    out = torch.empty(part.shape[1:], dtype=dtype, device=part.device)
    n = out.numel()
    if n > 0:
        grid = (triton.cdiv(n, _BLOCK_N),)
        _sum_partials_kernel[grid](
            part, out, part.shape[0], n, BLOCK_P=_BLOCK_P, BLOCK_N=_BLOCK_N, num_warps=_WARPS
        )
    return out
