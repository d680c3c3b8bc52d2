"""Table-batched embedding lookup with hashing, and its backward fused with the optimizer update.

The idea of FBGEMM's "table-batched embedding" (TBE): all F tables live in one weight buffer, table f in
rows [offsets[f], offsets[f] + rows[f]), so one launch serves every table and every sample.

Math (letters of dlrm/model/dlrm.py: B batch, F sparse features, D embedding dim, R total rows)
    forward    row[b, f] = (ids[b, f] + 1) mod rows[f]      ("modulus" hashing, floor mod)
               row[b, f] = ids[b, f]                         ("index": rows already mapped, e.g. by a vocab)
               index[b, f] = offsets[f] + row[b, f]
               out[b, f, :] = weights[index[b, f], :]
    backward   the optimizer's step on the touched rows, in place (``kernels.embedding_update``): no
               gradient of the weights leaves the op

Shapes and dtypes: weights [R, D] fp32 or bf16 (updates computed in fp32, rounded once: bf16 to nearest, or
stochastically given `rounding`, kernels/embedding_update.py); state fp32 ([R, D] for adagrad, [R] for
rowwise_adagrad, empty for sgd); ids [B, F] int64 raw category ids (-1 = missing, which lands in row 0);
offsets, rows [F] int64; out [B, F, D] in weights' dtype or `out_dtype` (bf16 rows read as they are and
written as fp32 exactly); index [B, F] int64 (saved for backward instead of recomputing the hashing).
Offsets are int64: R * D passes 2**31 at Kaggle sizes.

Everything has a fixed shape (no torch.unique, no host sync), so a step can be captured in a CUDA graph.
The learning rate is a one-element fp32 tensor on the tables' device that the update kernels load, not a
number baked into the launch: a learning-rate schedule writes it in place between steps (`lr.fill_`), and
a captured graph's replays read the current value (train.lr_schedule, dlrm/lr_schedule.py).
The PyTorch reference is `embedding_lookup_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.embedding_update import (
    OPTIMIZERS,
    block_sizes,
    check_optimizer,
    check_rounding,
    column_block,
    embedding_update,
    update_lr,
)
from kernels.launch import use_triton
from kernels.op import define_op

__all__ = [
    "HASHINGS",
    "OPTIMIZERS",
    "check_hashing",
    "check_tables",
    "embedding_lookup",
    "embedding_lookup_ref",
]

HASHINGS = ("modulus", "index")
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def table_row(x, rows, HASHING: tl.constexpr):
    """The row within its table of each raw id of x (int64): (x + 1) floor-mod rows for "modulus", x
    itself for "index" (rows unused)."""
    if HASHING == "modulus":
        row = (x + 1) % rows
        # Floor mod whatever the sign convention of % (ids below -1 are not Criteo's, but stay in range).
        row = tl.where(row < 0, row + rows, row)
    else:
        row = x
    return row


@triton.jit(do_not_specialize=["B"])
def _embedding_fwd_kernel(
    # pointers
    ids_ptr,  # [B, F] int64 raw ids (or rows, for HASHING "index")
    offsets_ptr,  # [F] int64 first row of each table
    rows_ptr,  # [F] int64 rows of each table
    weights_ptr,  # [R, D] fp32/bf16
    out_ptr,  # [B, F, D] weights' dtype or out_dtype
    index_ptr,  # [B, F] int64 global row of each lookup
    # sizes
    B,
    F,
    D,
    # meta-parameters
    HASHING: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Program p: table p % F, samples from p // F * BLOCK_B. Neighbouring programs read neighbouring ids
    # and write neighbouring output rows (kaggle's lookups, B=65,536, on an H200: 75 us, against 115 with
    # the blocks of one table in a row).
    f, b, mask_b, lookup = column_block(tl.program_id(0), F, B, BLOCK_B)  # lookup: position in [B, F]
    x = tl.load(ids_ptr + lookup, mask=mask_b, other=0)
    rows = tl.load(rows_ptr + f) if HASHING == "modulus" else 0  # "index" reads no table sizes
    index = tl.load(offsets_ptr + f) + table_row(x, rows, HASHING)
    tl.store(index_ptr + lookup, index, mask=mask_b)
    d = tl.arange(0, BLOCK_D)
    mask = mask_b[:, None] & (d < D)[None, :]
    values = tl.load(weights_ptr + index[:, None] * D + d[None, :], mask=mask)
    tl.store(out_ptr + lookup[:, None] * D + d[None, :], values.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def check_tables(weights: Tensor, offsets: Tensor, rows: Tensor) -> None:
    """Raises ValueError unless weights is a contiguous [R, D] fp32/bf16 buffer and offsets, rows are [F]
    int64 on its device."""
    if weights.ndim != 2 or weights.shape[1] < 1:
        raise ValueError(f"weights must be [R, D] with D >= 1, got shape {list(weights.shape)}")
    if weights.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weights dtype {weights.dtype} not supported: expected one of {WEIGHT_DTYPES}")
    if not weights.is_contiguous():
        raise ValueError("weights must be contiguous (one [R, D] row-major buffer)")
    for name, t in (("offsets", offsets), ("rows", rows)):
        if t.ndim != 1 or t.dtype != torch.int64 or t.device != weights.device:
            raise ValueError(
                f"{name} must be a 1-D int64 tensor on {weights.device}, got {t.dtype} {list(t.shape)} "
                f"on {t.device}"
            )
    if offsets.shape != rows.shape:
        raise ValueError(f"offsets {list(offsets.shape)} and rows {list(rows.shape)} differ in shape")


def check_hashing(hashing: str) -> None:
    """Raises ValueError unless `hashing` is one of HASHINGS."""
    if hashing not in HASHINGS:
        raise ValueError(f"unknown hashing {hashing!r}: expected one of {HASHINGS}")


def _check_ids(ids: Tensor, offsets: Tensor, hashing: str) -> None:
    check_hashing(hashing)
    if ids.ndim != 2 or ids.shape[1] != offsets.shape[0] or ids.dtype != torch.int64:
        raise ValueError(f"ids must be [B, {offsets.shape[0]}] int64, got {ids.dtype} {list(ids.shape)}")
    if ids.device != offsets.device:
        raise ValueError(f"ids on {ids.device} but tables on {offsets.device}")


def embedding_lookup_fwd(
    weights: Tensor,
    offsets: Tensor,
    rows: Tensor,
    ids: Tensor,
    hashing: str,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Launch the lookup kernel: (out [B, F, D] in out_dtype (None: weights' dtype), index [B, F] int64).
    See `embedding_lookup`."""
    check_tables(weights, offsets, rows)
    _check_ids(ids, offsets, hashing)
    ids = ids.contiguous()
    b, f = ids.shape
    d = weights.shape[1]
    out = torch.empty(b, f, d, dtype=out_dtype or weights.dtype, device=weights.device)
    index = torch.empty_like(ids)
    if b == 0:
        return out, index
    block_d, block_b = block_sizes(d, b)
    _embedding_fwd_kernel[(f * triton.cdiv(b, block_b),)](
        ids, offsets, rows, weights, out, index, b, f, d, HASHING=hashing, BLOCK_B=block_b, BLOCK_D=block_d
    )
    return out, index


# --------------------------------------------------------------------------------------------------
# PyTorch references (tests, benchmarks, CPU fallback)
# --------------------------------------------------------------------------------------------------


def embedding_lookup_ref(
    weights: Tensor,
    offsets: Tensor,
    rows: Tensor,
    ids: Tensor,
    hashing: str,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """PyTorch lookup: (weights[index] [B, F, D] in out_dtype (None: weights' dtype), index [B, F]) with
    index as in the module docstring."""
    row = torch.remainder(ids + 1, rows) if hashing == "modulus" else ids
    index = row + offsets
    return weights[index].to(out_dtype or weights.dtype), index


# --------------------------------------------------------------------------------------------------
# Autograd glue: the lookup is a custom op whose backward applies the optimizer update; eager calls run
# the same body and formulas without the dispatcher (kernels/op.py)
# --------------------------------------------------------------------------------------------------


def _lookup_impl(
    weights: Tensor,
    state: Tensor,
    offsets: Tensor,
    rows: Tensor,
    ids: Tensor,
    hashing: str,
    optimizer: str,
    lr: Tensor,
    eps: float,
    out_dtype: torch.dtype,
    rounding: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    if use_triton(weights):
        return embedding_lookup_fwd(weights, offsets, rows, ids, hashing, out_dtype)
    check_tables(weights, offsets, rows)
    _check_ids(ids, offsets, hashing)
    return embedding_lookup_ref(weights, offsets, rows, ids, hashing, out_dtype)


def _lookup_fake(weights, state, offsets, rows, ids, hashing, optimizer, lr, eps, out_dtype, rounding=None):
    out = torch.empty(ids.shape[0], ids.shape[1], weights.shape[1], dtype=out_dtype, device=weights.device)
    return out, torch.empty_like(ids)


def _update_fake(weights, state, index, grad, optimizer, lr, eps, rounding=None) -> None:
    return None


def _setup_context(ctx, inputs, output) -> None:
    weights, state, _, _, _, _, optimizer, lr, eps, _, rounding = inputs
    _, index = output
    # The weights are saved only to be updated in backward (after they are unpacked, so autograd's
    # saved-tensor version check still holds). The lr and rounding tensors are saved as they are, not
    # their values: their owners write them between steps, never between a step's forward and backward.
    ctx.save_for_backward(weights, state, index, lr, rounding)
    ctx.optimizer, ctx.eps = optimizer, eps
    ctx.mark_non_differentiable(index)


def _backward(update_fn, ctx, grad_out: Tensor, _grad_index):
    # update_fn: the update op, or the function it runs on the eager path.
    weights, state, index, lr, rounding = ctx.saved_tensors
    update_fn(weights, state, index, grad_out, ctx.optimizer, lr, ctx.eps, rounding)
    # The weights were updated in place: no gradient leaves this op.
    return (None,) * 11


# The backward op is the in-place update dlrm::embedding_update, which returns nothing.
_embedding_lookup = define_op(
    "embedding_lookup", _lookup_impl, _lookup_fake, _setup_context, _backward, embedding_update, _update_fake,
    backward_name="embedding_update", backward_mutates=("weights", "state"),
)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def embedding_lookup(
    weights: Tensor,
    state: Tensor,
    offsets: Tensor,
    rows: Tensor,
    ids: Tensor,
    hashing: str = "modulus",
    optimizer: str = "sgd",
    lr: Tensor | None = None,
    eps: float = 1e-10,
    out_dtype: torch.dtype | None = None,
    rounding: Tensor | None = None,
) -> Tensor:
    """Look up F tables at once from raw ids; backward updates the weights in place (fused optimizer).

    Runs the Triton kernels on CUDA (and on CPU under TRITON_INTERPRET=1), else the PyTorch references.
    The result is differentiable when `weights.requires_grad`; its backward returns no weight gradient but
    applies `optimizer` to the touched rows of `weights` and `state` (module docstring), so the weights must
    not also be given to a torch optimizer. It is the custom op `torch.ops.dlrm.embedding_lookup`.

    Args:
        weights: [R, D] fp32 or bf16, the F tables stacked by rows (contiguous).
        state: optimizer state from `optimizer_state(weights, optimizer)`.
        offsets: [F] int64, first row of each table in `weights`.
        rows: [F] int64, rows of each table (for "modulus" hashing).
        ids: [B, F] int64 raw ids (-1 = missing) for "modulus"; rows within each table for "index".
        hashing: "modulus" (row = (id + 1) mod rows[f]) or "index" (ids are rows already).
        optimizer: "sgd", "adagrad" or "rowwise_adagrad"; eps: Adagrad's epsilon.
        lr: the learning rate of the backward's update, a one-element fp32 tensor on weights' device,
            read by the kernel when backward runs (so `lr.fill_(x)` between steps changes it, also under
            CUDA graph replay). None only for lookups without an update (weights without grad, or
            under torch.no_grad()).
        out_dtype: dtype of the result (None: weights' dtype), e.g. bf16 from fp32 tables under bf16
            autocast: the kernel rounds as it stores, with no separate cast pass forward or backward (the
            update reads a gradient of any float dtype). From bf16 tables, fp32 is exact.
        rounding: for bf16 weights, [2] int64 (seed, count) on weights' device, read when backward runs:
            the update rounds stochastically with the bits of (seed, count) (kernels/embedding_update.py;
            the caller advances the count between steps); None: to nearest.
    Returns:
        [B, F, D] in out_dtype: out[b, f] = weights[offsets[f] + row(ids[b, f])].
    Raises:
        ValueError: shapes, dtypes, devices, hashing, optimizer or lr not as above (the message names them).
    """
    check_optimizer(optimizer)
    out_dtype = weights.dtype if out_dtype is None else out_dtype
    lr = update_lr(lr, weights, "embedding_lookup")
    check_rounding(rounding, weights)
    out, _ = _embedding_lookup(
        weights, state, offsets, rows, ids, hashing, optimizer, lr, eps, out_dtype, rounding
    )
    return out
