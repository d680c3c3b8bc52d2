"""Table-batched embedding lookup with hashing, and its backward fused with the optimizer update.

The idea of FBGEMM's "table-batched embedding" (TBE): all F tables live in one weight buffer, table f in
rows [offsets[f], offsets[f] + rows[f]), so one launch serves every table and every sample.

Math (letters of dlrm/model/dlrm.py: B batch, F sparse features, D embedding dim, R total rows)
    forward    row[b, f] = (ids[b, f] + 1) mod rows[f]      ("modulus" hashing, floor mod)
               row[b, f] = ids[b, f]                         ("index": rows already mapped, e.g. by a vocab)
               index[b, f] = offsets[f] + row[b, f]
               out[b, f, :] = weights[index[b, f], :]
    backward   g_r = sum of dout[b, f, :] over the (b, f) with index[b, f] = r   (repeated ids summed)
      "sgd"              w_r -= lr * g_r
      "adagrad"          s_r += g_r^2 (elementwise, state [R, D]);     w_r -= lr * g_r / (sqrt(s_r) + eps)
      "rowwise_adagrad"  s_r += mean(g_r^2) (one value per row, [R]);  w_r -= lr * g_r / (sqrt(s_r) + eps)
    "sgd" and "adagrad" are torch.optim.SGD / torch.optim.Adagrad (lr_decay 0, initial accumulator 0) on
    sparse gradients; "rowwise_adagrad" is FBGEMM/TorchRec's EXACT_ROWWISE_ADAGRAD. Only touched rows change.

Shapes and dtypes: weights [R, D] fp32 or bf16 (updates computed in fp32, rounded once); state fp32 ([R, D]
for adagrad, [R] for rowwise_adagrad, empty for sgd); ids [B, F] int64 raw category ids (-1 = missing, which
lands in row 0); offsets, rows [F] int64; out [B, F, D] in weights' dtype; index [B, F] int64 (saved for
backward instead of recomputing the hashing). Offsets are int64: R * D passes 2**31 at Kaggle sizes.

How backward applies the update, without a table-sized gradient:
- "sgd" with fp32 weights: one kernel, atomic adds of -lr * dout straight into the touched rows. Atomic adds
  sum repeated ids exactly (up to fp32 summation order), as SGD needs nothing but the sum.
- otherwise (adagrad, rowwise_adagrad, bf16 weights): the non-linear update needs each row's full sum
  first. The B*F indices are sorted (torch.sort); sorted positions with the same row form a segment; one
  kernel sums dout into a [B*F, D] fp32 buffer by segment (atomics into distinct slots per segment), a second
  updates each distinct row once from its segment's sum. Memory is O(B F D), never O(R D).

Everything has a fixed shape (no torch.unique, no host sync), so a step can be captured in a CUDA graph.
The learning rate is a one-element fp32 tensor on the tables' device that the update kernels load, not a
number baked into the launch: a learning-rate schedule writes it in place between steps (`lr.fill_`), and
a captured graph's replays read the current value (train.lr_schedule, dlrm/lr_schedule.py).
The PyTorch references are `embedding_lookup_ref` and `embedding_update_ref`.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.direct import call, eager_function
from kernels.launch import use_triton

__all__ = [
    "HASHINGS",
    "OPTIMIZERS",
    "embedding_lookup",
    "embedding_lookup_ref",
    "embedding_update",
    "embedding_update_ref",
    "optimizer_state",
]

HASHINGS = ("modulus", "index")
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


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
    pid_b = tl.program_id(0)
    f = tl.program_id(1)
    b = pid_b.to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    mask_b = b < B
    lookup = b * F + f  # position in [B, F]
    x = tl.load(ids_ptr + lookup, mask=mask_b, other=0)
    if HASHING == "modulus":
        rows = tl.load(rows_ptr + f)
        row = (x + 1) % rows
        # Floor mod whatever the sign convention of % (ids below -1 are not Criteo's, but stay in range).
        row = tl.where(row < 0, row + rows, row)
    else:
        row = x
    index = tl.load(offsets_ptr + f) + row
    tl.store(index_ptr + lookup, index, mask=mask_b)
    d = tl.arange(0, BLOCK_D)
    mask = mask_b[:, None] & (d < D)[None, :]
    values = tl.load(weights_ptr + index[:, None] * D + d[None, :], mask=mask)
    tl.store(out_ptr + lookup[:, None] * D + d[None, :], values.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["N"])
def _embedding_sgd_kernel(
    # pointers
    index_ptr,  # [N] int64 global rows (N = B * F lookups)
    grad_ptr,  # [N, D] dout, any float dtype
    weights_ptr,  # [R, D] fp32, updated in place
    lr_ptr,  # [] fp32 learning rate, read at launch time (a schedule changes it between graph replays)
    # sizes
    N,
    D,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask_n = n < N
    d = tl.arange(0, BLOCK_D)
    mask = mask_n[:, None] & (d < D)[None, :]
    index = tl.load(index_ptr + n, mask=mask_n, other=0)
    grad = tl.load(grad_ptr + n[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    lr = tl.load(lr_ptr).to(tl.float32)
    tl.atomic_add(weights_ptr + index[:, None] * D + d[None, :], -lr * grad, mask=mask)


@triton.jit(do_not_specialize=["N"])
def _embedding_segment_sum_kernel(
    # pointers
    order_ptr,  # [N] int64: lookup at each sorted position (argsort of the indices)
    segment_ptr,  # [N] int64: segment (distinct row, in sorted order) of each sorted position
    grad_ptr,  # [N, D] dout, any float dtype
    sums_ptr,  # [N, D] fp32 zeros: one slot per segment, the first n_segments used
    # sizes
    N,
    D,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask_p = p < N
    d = tl.arange(0, BLOCK_D)
    mask = mask_p[:, None] & (d < D)[None, :]
    lookup = tl.load(order_ptr + p, mask=mask_p, other=0)
    segment = tl.load(segment_ptr + p, mask=mask_p, other=0)
    grad = tl.load(grad_ptr + lookup[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.atomic_add(sums_ptr + segment[:, None] * D + d[None, :], grad, mask=mask)


@triton.jit(do_not_specialize=["N", "eps"])
def _embedding_segment_update_kernel(
    # pointers
    sorted_ptr,  # [N] int64 sorted global rows
    segment_ptr,  # [N] int64 segment of each sorted position
    sums_ptr,  # [N, D] fp32 gradient sum of each segment
    weights_ptr,  # [R, D] fp32/bf16, updated in place
    state_ptr,  # adagrad: [R, D] fp32; rowwise_adagrad: [R] fp32; sgd: unused
    lr_ptr,  # [] fp32 learning rate, read at launch time (a schedule changes it between graph replays)
    # sizes
    N,
    D,
    # optimizer
    eps,
    # meta-parameters
    OPTIMIZER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    valid = p < N
    row = tl.load(sorted_ptr + p, mask=valid, other=-1)
    previous = tl.load(sorted_ptr + p - 1, mask=(p > 0) & valid, other=-1)
    # The first sorted position of each distinct row applies that row's update; the others do nothing.
    head = valid & (row != previous)
    # 1-D loads are masked by `valid`, not by the data-dependent `head`: Triton 3.6 fails to compile a
    # load masked by `head` here (TritonGPURemoveLayoutConversions), and reading more is harmless.
    segment = tl.load(segment_ptr + p, mask=valid, other=0)
    d = tl.arange(0, BLOCK_D)
    mask = head[:, None] & (d < D)[None, :]
    grad = tl.load(sums_ptr + segment[:, None] * D + d[None, :], mask=mask, other=0.0)
    w_ptrs = weights_ptr + row[:, None] * D + d[None, :]
    weights = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    lr = tl.load(lr_ptr).to(tl.float32)
    if OPTIMIZER == "sgd":
        step = lr * grad
    elif OPTIMIZER == "adagrad":
        s_ptrs = state_ptr + row[:, None] * D + d[None, :]
        state = tl.load(s_ptrs, mask=mask, other=0.0) + grad * grad
        tl.store(s_ptrs, state, mask=mask)
        step = lr * grad / (tl.sqrt(state) + eps)
    else:
        state = tl.load(state_ptr + row, mask=valid, other=0.0) + tl.sum(grad * grad, axis=1) / D
        tl.store(state_ptr + row, state, mask=head)
        step = lr * grad / (tl.sqrt(state)[:, None] + eps)
    tl.store(w_ptrs, (weights - step).to(weights_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _block_d(d: int) -> int:
    return triton.next_power_of_2(d)


def _block_rows(block_d: int) -> int:
    """Rows per program: about 4096 elements of D per program, at least 16 rows."""
    return max(16, 4096 // block_d)


def _check_tables(weights: Tensor, offsets: Tensor, rows: Tensor) -> None:
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


def _check_ids(ids: Tensor, offsets: Tensor, hashing: str) -> None:
    if hashing not in HASHINGS:
        raise ValueError(f"unknown hashing {hashing!r}: expected one of {HASHINGS}")
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
    _check_tables(weights, offsets, rows)
    _check_ids(ids, offsets, hashing)
    ids = ids.contiguous()
    b, f = ids.shape
    d = weights.shape[1]
    out = torch.empty(b, f, d, dtype=out_dtype or weights.dtype, device=weights.device)
    index = torch.empty_like(ids)
    if b == 0:
        return out, index
    block_d = _block_d(d)
    block_b = min(_block_rows(block_d), triton.next_power_of_2(b))
    grid = (triton.cdiv(b, block_b), f)
    _embedding_fwd_kernel[grid](
        ids, offsets, rows, weights, out, index, b, f, d, HASHING=hashing, BLOCK_B=block_b, BLOCK_D=block_d
    )
    return out, index


def optimizer_state(weights: Tensor, optimizer: str) -> Tensor:
    """Fresh (zero) optimizer state for `weights` [R, D]: [R, D] fp32 for "adagrad", [R] fp32 for
    "rowwise_adagrad", an empty tensor for "sgd"."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown embedding optimizer {optimizer!r}: expected one of {OPTIMIZERS}")
    shape = {"sgd": (0,), "adagrad": tuple(weights.shape), "rowwise_adagrad": (weights.shape[0],)}[optimizer]
    return torch.zeros(shape, dtype=torch.float32, device=weights.device)


def _check_lr(lr: Tensor, weights: Tensor) -> None:
    ok = isinstance(lr, Tensor) and lr.numel() == 1 and lr.dtype == torch.float32
    if not ok or lr.device != weights.device:
        got = f"{lr.dtype} {list(lr.shape)} on {lr.device}" if isinstance(lr, Tensor) else repr(lr)
        raise ValueError(f"lr must be a one-element fp32 tensor on {weights.device}, got {got}")


def _check_update(weights: Tensor, state: Tensor, index: Tensor, grad: Tensor, optimizer: str) -> None:
    if optimizer == "adagrad" and tuple(state.shape) != tuple(weights.shape):
        raise ValueError(f"adagrad state must be {list(weights.shape)}, got {list(state.shape)}")
    if optimizer == "rowwise_adagrad" and tuple(state.shape) != (weights.shape[0],):
        raise ValueError(f"rowwise_adagrad state must be [{weights.shape[0]}], got {list(state.shape)}")
    if optimizer != "sgd" and (state.dtype != torch.float32 or not state.is_contiguous()):
        raise ValueError(f"optimizer state must be contiguous fp32, got {state.dtype}")
    if index.dtype != torch.int64 or grad.shape != (*index.shape, weights.shape[1]):
        raise ValueError(
            f"grad {list(grad.shape)} must be index {list(index.shape)} + [D={weights.shape[1]}], "
            f"index int64 (got {index.dtype})"
        )


def embedding_update(
    weights: Tensor, state: Tensor, index: Tensor, grad: Tensor, optimizer: str, lr: Tensor, eps: float
) -> None:
    """Apply one optimizer step to the rows of `weights` (and `state`) that `index` touched, in place.

    Args:
        weights: [R, D] fp32/bf16 table-batched weights (contiguous), updated in place.
        state: optimizer state from `optimizer_state` (fp32), updated in place.
        index: [B, F] (or any shape) int64 global rows looked up, as returned by the lookup.
        grad: index.shape + [D], gradient of the looked-up vectors (any float dtype).
        optimizer: "sgd", "adagrad" or "rowwise_adagrad" (module docstring).
        lr: learning rate, a one-element fp32 tensor on weights' device ([] or [1]), read by the kernel
            (no host sync; its value at launch, or at each replay of a captured graph, is the one used).
        eps: Adagrad's epsilon (unused by sgd).
    Raises:
        ValueError: unknown optimizer, or shapes/dtypes/devices that do not match (message names them).
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown embedding optimizer {optimizer!r}: expected one of {OPTIMIZERS}")
    _check_update(weights, state, index, grad, optimizer)
    _check_lr(lr, weights)
    if not use_triton(weights):
        embedding_update_ref(weights, state, index, grad, optimizer, lr, eps)
        return
    index = index.reshape(-1)
    grad = grad.reshape(index.numel(), -1).contiguous()
    n, d = grad.shape
    if n == 0:
        return
    block_d = _block_d(d)
    block_n = min(_block_rows(block_d), triton.next_power_of_2(n))
    grid = (triton.cdiv(n, block_n),)
    if optimizer == "sgd" and weights.dtype == torch.float32:
        _embedding_sgd_kernel[grid](index, grad, weights, lr, n, d, BLOCK_N=block_n, BLOCK_D=block_d)
        return
    sorted_rows, order = torch.sort(index)
    # Segment of each sorted position: the number of row changes before it.
    changes = torch.ne(sorted_rows[1:], sorted_rows[:-1])
    segment = torch.zeros_like(sorted_rows)
    torch.cumsum(changes, dim=0, out=segment[1:])
    sums = torch.zeros(n, d, dtype=torch.float32, device=grad.device)
    _embedding_segment_sum_kernel[grid](order, segment, grad, sums, n, d, BLOCK_N=block_n, BLOCK_D=block_d)
    _embedding_segment_update_kernel[grid](
        sorted_rows,
        segment,
        sums,
        weights,
        state,
        lr,
        n,
        d,
        eps,
        OPTIMIZER=optimizer,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )


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


def embedding_update_ref(
    weights: Tensor, state: Tensor, index: Tensor, grad: Tensor, optimizer: str, lr: Tensor, eps: float
) -> None:
    """PyTorch update of the touched rows, in place: sums repeated rows, then the module docstring's step.
    `lr`: a one-element fp32 tensor (as `embedding_update`)."""
    d = weights.shape[1]
    lr = lr.reshape(())  # [] or [1] -> [], broadcast against the [rows, D] sums
    rows, inverse = torch.unique(index.reshape(-1), return_inverse=True)
    g = torch.zeros(len(rows), d, dtype=torch.float32, device=weights.device)
    g.index_add_(0, inverse, grad.reshape(-1, d).float())
    if optimizer == "sgd":
        step = lr * g
    elif optimizer == "adagrad":
        state[rows] += g * g
        step = lr * g / (state[rows].sqrt() + eps)
    else:
        state[rows] += (g * g).mean(dim=1)
        step = lr * g / (state[rows].sqrt()[:, None] + eps)
    weights[rows] = (weights[rows].float() - step).to(weights.dtype)


# --------------------------------------------------------------------------------------------------
# Autograd glue: the lookup is a custom op whose backward applies the optimizer update; eager calls run
# the same body and formulas without the dispatcher (kernels/direct.py)
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
) -> tuple[Tensor, Tensor]:
    if use_triton(weights):
        return embedding_lookup_fwd(weights, offsets, rows, ids, hashing, out_dtype)
    _check_tables(weights, offsets, rows)
    _check_ids(ids, offsets, hashing)
    return embedding_lookup_ref(weights, offsets, rows, ids, hashing, out_dtype)


_lookup_op = torch.library.custom_op("dlrm::embedding_lookup", _lookup_impl, mutates_args=())


@_lookup_op.register_fake
def _lookup_fake(weights, state, offsets, rows, ids, hashing, optimizer, lr, eps, out_dtype):
    out = torch.empty(ids.shape[0], ids.shape[1], weights.shape[1], dtype=out_dtype, device=weights.device)
    return out, torch.empty_like(ids)


@torch.library.custom_op("dlrm::embedding_update", mutates_args=("weights", "state"))
def _update_op(
    weights: Tensor, state: Tensor, index: Tensor, grad: Tensor, optimizer: str, lr: Tensor, eps: float
) -> None:
    embedding_update(weights, state, index, grad, optimizer, lr, eps)


@_update_op.register_fake
def _update_fake(weights, state, index, grad, optimizer, lr, eps) -> None:
    return None


def _setup_context(ctx, inputs, output) -> None:
    weights, state, _, _, _, _, optimizer, lr, eps, _ = inputs
    _, index = output
    # The weights are saved only to be updated in backward (after they are unpacked, so autograd's
    # saved-tensor version check still holds). The lr tensor is saved as it is, not its value: a schedule
    # writes it between steps, never between a step's forward and backward.
    ctx.save_for_backward(weights, state, index, lr)
    ctx.optimizer, ctx.eps = optimizer, eps
    ctx.mark_non_differentiable(index)


def _backward(update_fn, ctx, grad_out: Tensor, _grad_index):
    # update_fn: the update op, or the function it runs on the eager path.
    weights, state, index, lr = ctx.saved_tensors
    update_fn(weights, state, index, grad_out, ctx.optimizer, lr, ctx.eps)
    # The weights were updated in place: no gradient leaves this op.
    return None, None, None, None, None, None, None, None, None, None


_lookup_op.register_autograd(partial(_backward, _update_op), setup_context=_setup_context)
_lookup_eager = eager_function(
    "EmbeddingLookup", _lookup_impl, _setup_context, partial(_backward, embedding_update)
)


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
            update reads a gradient of any float dtype).
    Returns:
        [B, F, D] in out_dtype: out[b, f] = weights[offsets[f] + row(ids[b, f])].
    Raises:
        ValueError: shapes, dtypes, devices, hashing, optimizer or lr not as above (the message names them).
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown embedding optimizer {optimizer!r}: expected one of {OPTIMIZERS}")
    out_dtype = weights.dtype if out_dtype is None else out_dtype
    if lr is None:
        if weights.requires_grad and torch.is_grad_enabled():
            raise ValueError("embedding_lookup: lr is required when backward updates the weights")
        lr = torch.zeros((), dtype=torch.float32, device=weights.device)
    _check_lr(lr, weights)
    out, _ = call(
        _lookup_op, _lookup_eager, weights, state, offsets, rows, ids, hashing, optimizer, lr, eps, out_dtype
    )
    return out
