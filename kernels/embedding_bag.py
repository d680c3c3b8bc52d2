"""Table-batched pooled embedding bags: gather and pool each bag in one launch, and a backward fused with
the optimizer update that steps every touched row once with the sum of its gradients.

All F tables live in one weight buffer (table f in rows [offsets[f], offsets[f] + rows[f])), as in
kernels/embedding.py, whose one-id lookup this generalizes to fixed-size bags.

Math (letters of dlrm/model/dlrm.py: B batch, F sparse features, D embedding dim, R total rows; k_f the bag
size of feature f, S = sum of k_f; column c of the [B, S] ids belongs to feature f(c), bags feature-major
as in dlrm/data/bags.py)
    forward    index[b, c] = offsets[f(c)] + (ids[b, c] + 1) mod rows[f(c)]    ("modulus"; "index": + ids)
               out[b, f, :] = scale_f * sum over the k_f columns c of f of weights[index[b, c], :]
               scale_f = 1 ("sum") or 1 / k_f ("mean")
    backward   each lookup (b, c) has the gradient scale_f(c) * dout[b, f(c), :];
               g_r = sum of those over every (b, c) with index[b, c] = r   (repeats inside and across bags)
      "sgd"              w_r -= lr * g_r
      "adagrad"          s_r += g_r^2 (elementwise, state [R, D]);     w_r -= lr * g_r / (sqrt(s_r) + eps)
      "rowwise_adagrad"  s_r += mean(g_r^2) (one value per row, [R]);  w_r -= lr * g_r / (sqrt(s_r) + eps)
    Every touched row takes ONE step a batch with its summed gradient (FBGEMM's EXACT_* optimizers): a
    row in 100 bags of a batch takes one Adagrad step, not 100. "sgd" and "adagrad" equal torch.optim.SGD /
    Adagrad (initial accumulator 0) on the sparse gradient of nn.EmbeddingBag.

Shapes and dtypes: weights [R, D] fp32 or bf16 (pooling and updates in fp32, rounded once: bf16 updates to
nearest, or stochastically given `rounding`, kernels/embedding_update.py); state fp32 (as
`kernels.embedding.optimizer_state`); ids [B, S] int64; offsets, rows, bag_sizes [F] int64; out [B, F, D] in
weights' dtype or `out_dtype`; index [B, S] (saved for backward) int32 where the rows fit (`index_dtype`),
else int64. Offsets are int64.

Backward without a table-sized gradient and without materializing the [B, S, D] per-lookup gradients:
- "sgd" with fp32 weights: one kernel over the B*S lookups, atomic adds of -lr * scale * dout[b, f(c)] into
  the looked-up rows (exact up to fp32 summation order).
- otherwise: the B*S indices are sorted (torch.sort), sorted positions of one row form a segment; a kernel
  steps each distinct row once, summing a short segment's pooled gradients itself and reading a long one's
  sum (small tables, hot rows) from the summing kernels' fp32 slot. Fixed shapes, no host sync: a step can
  be captured in a CUDA graph. The learning rate is a one-element fp32 tensor read by the kernels (a
  schedule writes it between steps).
The backward's launcher and reference live in kernels/embedding_bag_update.py, its kernels (shared with
the one-id lookups) in kernels/embedding_update.py. The PyTorch references are `embedding_bag_lookup_ref`
and `embedding_bag_update_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.embedding import check_hashing, check_tables, table_row
from kernels.embedding_bag_update import (
    POOLINGS,
    bag_columns,
    check_pooling,
    embedding_bag_update,
    embedding_bag_update_ref,
)
from kernels.embedding_update import block_sizes, check_optimizer, check_rounding, update_lr
from kernels.launch import use_triton
from kernels.op import define_op

__all__ = [
    "POOLINGS",
    "embedding_bag_lookup",
    "embedding_bag_lookup_ref",
    "embedding_bag_update",
    "embedding_bag_update_ref",
]

# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["B"])
def _embedding_bag_fwd_kernel(
    # pointers
    ids_ptr,  # [B, S] int64 raw ids (or rows, for HASHING "index")
    starts_ptr,  # [F] int64 first column of each feature's bag
    sizes_ptr,  # [F] int64 bag size k_f
    offsets_ptr,  # [F] int64 first row of each table
    rows_ptr,  # [F] int64 rows of each table
    weights_ptr,  # [R, D] fp32/bf16
    out_ptr,  # [B, F, D] out dtype
    index_ptr,  # [B, S] int32 or int64 (`index_dtype`): global row of each lookup
    # sizes
    B,
    F,
    S,
    D,
    # meta-parameters
    HASHING: tl.constexpr,
    MEAN: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Program (block, f): the blocks of one feature run in a row (dlrm_dcnv2, bf16 B=65,536 on an H200: 1,240
    # us, against 1,385 with the features interleaved, each neighbour a different bag size).
    f = tl.program_id(1)
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    mask_b = b < B
    start = tl.load(starts_ptr + f)
    k = tl.load(sizes_ptr + f)
    offset = tl.load(offsets_ptr + f)
    rows = tl.load(rows_ptr + f)
    d = tl.arange(0, BLOCK_D)
    mask = mask_b[:, None] & (d < D)[None, :]
    acc = tl.zeros((BLOCK_B, BLOCK_D), dtype=tl.float32)
    for j in range(0, k):
        lookup = b * S + start + j  # position in [B, S]
        x = tl.load(ids_ptr + lookup, mask=mask_b, other=0)
        index = offset + table_row(x, rows, HASHING)
        tl.store(index_ptr + lookup, index, mask=mask_b)
        acc += tl.load(weights_ptr + index[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if MEAN:
        acc = acc / k.to(tl.float32)
    out = out_ptr + (b * F + f)[:, None] * D + d[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _check(
    weights: Tensor, offsets: Tensor, rows: Tensor, bag_sizes: Tensor, ids: Tensor, hashing: str
) -> None:
    check_tables(weights, offsets, rows)
    # offsets is [F] int64 on weights' device (check_tables): bag_sizes must match it.
    if (
        bag_sizes.shape != offsets.shape
        or bag_sizes.dtype != torch.int64
        or bag_sizes.device != weights.device
    ):
        raise ValueError(
            f"bag_sizes must be a [F] int64 tensor on {weights.device} (F = {offsets.shape[0]}), got "
            f"{bag_sizes.dtype} {list(bag_sizes.shape)} on {bag_sizes.device}"
        )
    check_hashing(hashing)
    if ids.ndim != 2 or ids.dtype != torch.int64 or ids.device != weights.device:
        raise ValueError(f"ids must be [B, S] int64 on {weights.device}, got {ids.dtype} {list(ids.shape)}")


def index_dtype(rows: int) -> torch.dtype:
    """The dtype of the global rows a lookup over `rows` table-batched rows returns: int32 where they fit
    (rows <= 2**31: half the bytes the forward writes, and the update sorts them as they are), else int64."""
    return torch.int32 if rows <= 2**31 else torch.int64


def embedding_bag_fwd(
    weights: Tensor,
    offsets: Tensor,
    rows: Tensor,
    bag_sizes: Tensor,
    ids: Tensor,
    hashing: str,
    pooling: str,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Launch the pooled lookup: (out [B, F, D] in out_dtype (None: weights' dtype), index [B, S] in
    `index_dtype`).
    The columns of `ids` must be sum(bag_sizes) (not checked here: that would sync with the device)."""
    _check(weights, offsets, rows, bag_sizes, ids, hashing)
    check_pooling(pooling)
    ids = ids.contiguous()
    b, s = ids.shape
    f, d = offsets.shape[0], weights.shape[1]
    out = torch.empty(b, f, d, dtype=out_dtype or weights.dtype, device=weights.device)
    index = torch.empty(b, s, dtype=index_dtype(weights.shape[0]), device=ids.device)
    if b == 0:
        return out, index
    starts = torch.cumsum(bag_sizes, 0) - bag_sizes
    # Half the one-hot lookup's elements a program: each program waits on its bag's k gathers in turn, so
    # more, smaller programs keep more of them in flight (16 rows at D=128 measured faster than 32).
    block_d, block_b = block_sizes(d, b, elements=2048)
    grid = (triton.cdiv(b, block_b), f)
    _embedding_bag_fwd_kernel[grid](
        ids,
        starts,
        bag_sizes,
        offsets,
        rows,
        weights,
        out,
        index,
        b,
        f,
        s,
        d,
        HASHING=hashing,
        MEAN=pooling == "mean",
        BLOCK_B=block_b,
        BLOCK_D=block_d,
    )
    return out, index


# --------------------------------------------------------------------------------------------------
# PyTorch references (tests, benchmarks, CPU fallback)
# --------------------------------------------------------------------------------------------------


def embedding_bag_lookup_ref(
    weights: Tensor,
    offsets: Tensor,
    rows: Tensor,
    bag_sizes: Tensor,
    ids: Tensor,
    hashing: str,
    pooling: str,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """PyTorch pooled lookup, in fp32: (out [B, F, D] in out_dtype (None: weights' dtype), index [B, S])."""
    features, scales = bag_columns(bag_sizes, pooling, ids.shape[1])
    row = torch.remainder(ids + 1, rows[features]) if hashing == "modulus" else ids
    index = (row + offsets[features]).to(index_dtype(weights.shape[0]))
    vectors = weights[index].float() * scales[:, None]  # [B, S, D]
    out = torch.zeros(ids.shape[0], len(bag_sizes), weights.shape[1], device=weights.device)
    out.index_add_(1, features, vectors)
    return out.to(out_dtype or weights.dtype), index


# --------------------------------------------------------------------------------------------------
# Autograd glue: the lookup is a custom op whose backward applies the optimizer update; eager calls run
# the same body without the dispatcher (kernels/direct.py)
# --------------------------------------------------------------------------------------------------


def _lookup_impl(
    weights: Tensor,
    state: Tensor,
    offsets: Tensor,
    rows: Tensor,
    bag_sizes: Tensor,
    ids: Tensor,
    hashing: str,
    pooling: str,
    optimizer: str,
    lr: Tensor,
    eps: float,
    out_dtype: torch.dtype,
    rounding: Tensor | None = None,
    drop_last_row: bool = False,
) -> tuple[Tensor, Tensor]:
    if use_triton(weights):
        return embedding_bag_fwd(weights, offsets, rows, bag_sizes, ids, hashing, pooling, out_dtype)
    _check(weights, offsets, rows, bag_sizes, ids, hashing)
    check_pooling(pooling)
    return embedding_bag_lookup_ref(weights, offsets, rows, bag_sizes, ids, hashing, pooling, out_dtype)


def _lookup_fake(
    weights, state, offsets, rows, bag_sizes, ids, hashing, pooling, optimizer, lr, eps, out_dtype,
    rounding=None, drop_last_row=False,
):  # fmt: skip
    out = torch.empty(
        ids.shape[0], offsets.shape[0], weights.shape[1], dtype=out_dtype, device=weights.device
    )
    return out, torch.empty(ids.shape, dtype=index_dtype(weights.shape[0]), device=ids.device)


def _update_fake(
    weights, state, index, grad, bag_sizes, pooling, optimizer, lr, eps, rounding=None, in_order=False,
    drop_last_row=False,
) -> None:  # fmt: skip
    return None


def _setup_context(ctx, inputs, output) -> None:
    weights, state, _, _, bag_sizes, _, _, pooling, optimizer, lr, eps, _, rounding, drop_last_row = inputs
    _, index = output
    # The weights are saved only to be updated in backward; lr and rounding are saved as the tensors their
    # owners write between steps.
    ctx.save_for_backward(weights, state, index, bag_sizes, lr, rounding)
    ctx.pooling, ctx.optimizer, ctx.eps, ctx.drop_last_row = pooling, optimizer, eps, drop_last_row
    ctx.mark_non_differentiable(index)


def _backward(update_fn, ctx, grad_out: Tensor, _grad_index):
    # update_fn: the update op, or the function it runs on the eager path.
    weights, state, index, bag_sizes, lr, rounding = ctx.saved_tensors
    update_fn(
        weights, state, index, grad_out, bag_sizes, ctx.pooling, ctx.optimizer, lr, ctx.eps, rounding, False,
        ctx.drop_last_row,
    )  # fmt: skip
    return (None,) * 14  # the weights were updated in place: no gradient leaves this op


_embedding_bag_lookup = define_op(
    "embedding_bag_lookup", _lookup_impl, _lookup_fake, _setup_context, _backward, embedding_bag_update,
    _update_fake, backward_name="embedding_bag_update", backward_mutates=("weights", "state"),
)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def embedding_bag_lookup(
    weights: Tensor,
    state: Tensor,
    offsets: Tensor,
    rows: Tensor,
    bag_sizes: Tensor,
    ids: Tensor,
    hashing: str = "modulus",
    pooling: str = "sum",
    optimizer: str = "sgd",
    lr: Tensor | None = None,
    eps: float = 1e-10,
    out_dtype: torch.dtype | None = None,
    rounding: Tensor | None = None,
    drop_last_row: bool = False,
) -> Tensor:
    """Look up and pool F tables' bags at once; backward updates the weights in place (fused optimizer,
    every touched row once with its summed gradient).

    Runs the Triton kernels on CUDA (and on CPU under TRITON_INTERPRET=1), else the PyTorch references.
    The result is differentiable when `weights.requires_grad`; its backward returns no weight gradient but
    applies `optimizer` to the touched rows of `weights` and `state`. It is the custom op
    `torch.ops.dlrm.embedding_bag_lookup`.

    Args:
        weights: [R, D] fp32 or bf16, the F tables stacked by rows (contiguous).
        state: optimizer state from `kernels.embedding.optimizer_state(weights, optimizer)`.
        offsets: [F] int64 first row of each table; rows: [F] int64 rows of each table.
        bag_sizes: [F] int64 bag size k_f >= 1 of each feature (sum S = ids' columns).
        ids: [B, S] int64 raw ids (-1 = missing) for "modulus", rows within each table for "index"; feature
            f's bag in k_f consecutive columns, features in order.
        hashing: "modulus" (row = (id + 1) mod rows[f]) or "index".
        pooling: "sum" or "mean" (sum / k_f).
        optimizer: "sgd", "adagrad" or "rowwise_adagrad"; eps: Adagrad's epsilon.
        lr: the update's learning rate, a one-element fp32 tensor on weights' device (read when backward
            runs); None only for lookups without an update.
        out_dtype: dtype of the result (None: weights' dtype); pooling is in fp32, rounded once as stored.
        rounding: for bf16 weights, [2] int64 (seed, count) on weights' device, read when backward runs:
            the update rounds stochastically (kernels/embedding_update.py); None: to nearest.
        drop_last_row: the update leaves weights' last row R - 1 (a row-wise shard's padding row,
            dlrm.parallel.sharded_bags) and its state as they are and never reads its lookups' gradients;
            the forward still pools the row as it is.
    Returns:
        [B, F, D] in out_dtype: the pooled bags.
    Raises:
        ValueError: shapes, dtypes, devices, hashing, pooling, optimizer or lr not as above.
    """
    check_optimizer(optimizer)
    check_pooling(pooling)
    out_dtype = weights.dtype if out_dtype is None else out_dtype
    lr = update_lr(lr, weights, "embedding_bag_lookup")
    check_rounding(rounding, weights)
    out, _ = _embedding_bag_lookup(
        weights, state, offsets, rows, bag_sizes, ids, hashing, pooling, optimizer, lr, eps, out_dtype,
        rounding, drop_last_row,
    )  # fmt: skip
    return out
