"""The sharded tables' vectors between the exchange's block order and table order, one pass each way.

After the pooled vectors' all_to_all a rank holds, for its b samples, W blocks (one per rank q, the tables
rank q holds a shard of: block q is [b, n_q, D] at element b D C_q of the flat buffer `back`, C_q = the
columns of the blocks before q) and the replicated tables' local block `local` [b, n_r, D]. Table f is
the sum of its sources (q, j), column j of block q (block W: `local`): one source for a whole table, k for
a table split by rows over k ranks (each gives zeros where its shard lacks the row, so the sum is exact).

    gather:   out[r, f, :] = sum over (q, j) in sources(f) of block_q[r, j, :]          out [b, F, D]
    scatter:  block_q[r, j, :] = scale_q * grad[r, f, :]  for each (q, j) in sources(f)   (its backward)

with scale_q = `scale` for the exchanged blocks (the 1/W of a per-rank mean loss, see
dlrm.parallel.sharded) and 1 for `local`. Each is one kernel over (row blocks, columns) that loads each
value once, adds in fp32 and stores in the destination's dtype, so the dtype changes of the exchange
(bf16 on the wire, fp32 replicated tables) cost no pass of their own. torch.stack of the strided column
views (the reference) runs CatArrayBatchedCopy, several times slower on the D-value rows of a large batch.

Shapes: back [b * D * sum(n_q)] (any float dtype), local [b, n_r, D] (fp32 or the lookup's dtype),
out [b, F, D] `out_dtype`; grad [b, F, D], any strides along b and F (D's 1: read in place). Offsets
are int64 (b F D passes 2^31 at large batches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.launch import use_triton

__all__ = ["ColumnOrder"]

FIELDS = 4  # a source's fields: columns before its block, its block's width, its column, 1 if local


@triton.jit
def _rows_and_dims(b, D, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's rows [BLOCK_B, 1] int64, dims [1, BLOCK_D] and their mask."""
    r = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    return r, d, (r < b) & (d < D)


@triton.jit
def _source(source_ptr, r, d, b, D):
    """(offset of the source's values for rows r and dims d, 1 if it is in `local`)."""
    before = tl.load(source_ptr).to(tl.int64)
    width = tl.load(source_ptr + 1).to(tl.int64)
    column = tl.load(source_ptr + 2).to(tl.int64)
    local = tl.load(source_ptr + 3)
    start = tl.where(local != 0, 0, before * b * D)
    return start + r * width * D + column * D + d, local


@triton.jit(do_not_specialize=["b"])
def _gather_kernel(
    back_ptr, local_ptr, out_ptr, sources_ptr, counts_ptr, b, F, D,
    K: tl.constexpr, FIELDS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (row block, table f): out[r, f] = the sum of f's sources (at most K)."""
    f = tl.program_id(1)
    r, d, mask = _rows_and_dims(b, D, BLOCK_B, BLOCK_D)
    count = tl.load(counts_ptr + f)
    acc = tl.zeros((BLOCK_B, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(K):
        offset, local = _source(sources_ptr + (f * K + k) * FIELDS, r, d, b, D)
        present = mask & (k < count)
        acc += tl.load(back_ptr + offset, mask=present & (local == 0), other=0.0).to(tl.float32)
        acc += tl.load(local_ptr + offset, mask=present & (local != 0), other=0.0).to(tl.float32)
    tl.store(out_ptr + r * F * D + f * D + d, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["b"])
def _scatter_kernel(
    grad_ptr, back_ptr, local_ptr, targets_ptr, tables_ptr, b, D, stride_b, stride_f, scale,
    FIELDS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (row block, destination column c of table tables[c]): the column gets grad[r, f] (grad's
    strides stride_b, stride_f, 1), times `scale` where it is exchanged."""
    c = tl.program_id(1)
    r, d, mask = _rows_and_dims(b, D, BLOCK_B, BLOCK_D)
    f = tl.load(tables_ptr + c).to(tl.int64)
    g = tl.load(grad_ptr + r * stride_b + f * stride_f + d, mask=mask, other=0.0).to(tl.float32)
    offset, local = _source(targets_ptr + c * FIELDS, r, d, b, D)
    tl.store(back_ptr + offset, (g * scale).to(back_ptr.dtype.element_ty), mask=mask & (local == 0))
    tl.store(local_ptr + offset, g.to(local_ptr.dtype.element_ty), mask=mask & (local != 0))


class ColumnOrder:
    """The placement of F tables' columns in the exchange's blocks, and the two passes between it and
    table order (module docstring).

    Args:
        widths: n_q for each block, the local block last (W + 1 ints).
        sources: for each table f, its (block q, column j) places (at least one each); q = len(widths) - 1
            is the local block.
        device: where the kernels' descriptors live.
    Raises:
        ValueError: a table without a source, or a source outside its block.
    """

    def __init__(self, widths: list[int], sources: list[list[tuple[int, int]]], device: torch.device):
        for f, places in enumerate(sources):
            if not places or any(not (0 <= q < len(widths) and 0 <= j < widths[q]) for q, j in places):
                raise ValueError(f"table {f}: sources {places} do not fit blocks of widths {widths}")
        self.widths, self.sources = list(widths), [list(p) for p in sources]
        self.local = len(widths) - 1
        before = [sum(widths[:q]) for q in range(len(widths))]

        def fields(q: int, j: int) -> list[int]:
            return [before[q], widths[q], j, int(q == self.local)]

        self.k = max(len(p) for p in sources)
        padded = [[fields(q, j) for q, j in p] + [[0, 1, 0, 0]] * (self.k - len(p)) for p in sources]
        as_int32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
        self.gather_sources = as_int32(padded).reshape(-1)
        self.counts = as_int32([len(p) for p in sources])
        targets = [(f, q, j) for f, p in enumerate(sources) for q, j in p]
        self.scatter_targets = as_int32([fields(q, j) for _, q, j in targets]).reshape(-1)
        self.scatter_tables = as_int32([f for f, _, _ in targets])

    def gather(self, back: Tensor, local: Tensor, b: int, d: int, out_dtype: torch.dtype) -> Tensor:
        """back [b d sum(n_q)] flat, local [b, n_r, d] -> out [b, F, d] `out_dtype` (module docstring)."""
        tables = len(self.sources)
        if not use_triton(back):
            return self._gather_ref(back, local, b, d).to(out_dtype)
        out = torch.empty(b, tables, d, dtype=out_dtype, device=back.device)
        block_b, block_d = _blocks(d)
        local = local.contiguous() if local.numel() else back
        grid = (triton.cdiv(b, block_b), tables)
        _gather_kernel[grid](
            back, local, out, self.gather_sources, self.counts, b, tables, d,
            K=self.k, FIELDS=FIELDS, BLOCK_B=block_b, BLOCK_D=block_d,
        )  # fmt: skip
        return out

    def scatter(
        self, grad: Tensor, b: int, d: int, scale: float, back_dtype: torch.dtype, local_dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """grad [b, F, d] -> (grad_back [b d sum(n_q)] `back_dtype`, scaled by `scale`; grad_local
        [b, n_r, d] `local_dtype`): every source's gradient, gather's backward."""
        n = sum(self.widths[: self.local])
        grad_back = torch.empty(b * d * n, dtype=back_dtype, device=grad.device)
        grad_local = torch.empty(b, self.widths[self.local], d, dtype=local_dtype, device=grad.device)
        if not use_triton(grad):
            return self._scatter_ref(grad, b, d, scale, grad_back, grad_local)
        # Read in place where D is contiguous: the interaction's backward hands the tables' gradient as a
        # view of x0's ([b, F, D] of rows 27 D apart under DCN), whose copy would be a pass of its own.
        if grad.stride(2) != 1:
            grad = grad.contiguous()
        block_b, block_d = _blocks(d)
        local = grad_local if grad_local.numel() else grad_back
        grid = (triton.cdiv(b, block_b), self.scatter_tables.numel())
        _scatter_kernel[grid](
            grad, grad_back, local, self.scatter_targets, self.scatter_tables, b, d, grad.stride(0),
            grad.stride(1), scale, FIELDS=FIELDS, BLOCK_B=block_b, BLOCK_D=block_d,
        )  # fmt: skip
        return grad_back, grad_local

    def _blocks_of(self, back: Tensor, local: Tensor, b: int, d: int) -> list[Tensor]:
        sizes = [b * w * d for w in self.widths[: self.local]]
        blocks = zip(back.split(sizes), self.widths[: self.local], strict=True)
        return [x.view(b, w, d) for x, w in blocks] + [local]

    def _gather_ref(self, back: Tensor, local: Tensor, b: int, d: int) -> Tensor:
        """PyTorch reference of `gather` (strided copies per table), in the promoted dtype."""
        blocks = self._blocks_of(back, local, b, d)
        dtype = torch.promote_types(back.dtype, local.dtype)
        out = torch.stack([blocks[q][:, j].to(dtype) for (q, j), *_ in self.sources], dim=1)
        for f, (_, *more) in enumerate(self.sources):
            for q, j in more:
                out[:, f] += blocks[q][:, j]
        return out

    def _scatter_ref(
        self, grad: Tensor, b: int, d: int, scale: float, grad_back: Tensor, grad_local: Tensor
    ) -> tuple[Tensor, Tensor]:
        """PyTorch reference of `scatter`, into the given buffers."""
        blocks = self._blocks_of(grad_back, grad_local, b, d)
        for f, places in enumerate(self.sources):
            for q, j in places:
                g = grad[:, f] if q == self.local else grad[:, f] * scale
                blocks[q][:, j] = g
        return grad_back, grad_local


def _blocks(d: int) -> tuple[int, int]:
    """(BLOCK_B, BLOCK_D): D padded to a power of two, rows to make 4,096-value tiles."""
    block_d = triton.next_power_of_2(d)
    return max(1, 4096 // block_d), block_d
