"""The backward of linear_act: ``dz = dy * act'``, ``dx = dz @ W``, ``dW = dz^T @ x``, ``db = sum over rows of
dz`` (math, shapes and dtypes in ``kernels/linear_act.py``), and the choice between its two implementations.

  "cublas": ``_linear_act_dz_kernel`` writes dz = dy * act' (rounded to x's dtype) and the bias gradient's
      partial sums in one pass over [M, N], then cuBLAS computes dx = dz @ W and dW = dz^T @ x.
  "triton" (dW and db only): the Triton dW GEMM of ``kernels/linear_act_dw.py``, dz formed in registers, so
      no [M, N] pass for dz.

Which one runs (CUDA-graph replays of each backward alone over the kaggle and mlperf layers are in
scripts/results/linear_act_backward.csv):
  - dx needed (every layer but the first): always "cublas", not timed: a Triton dx GEMM with dz fused into
    its loads is slower than cuBLAS's on nearly every layer, and not enough faster on the rest to keep.
  - no dx (the first layer, whose input is data: K = 13 dense features): the faster of the two, timed as
    graph replays the first time a shape is seen on the GPU (``_pick_backward``); which one wins depends on
    the precision and the batch. The backward reads x's 16-byte-row copy, as the op hands it over, so the
    timed choice sees the op's real inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.testing
from torch import Tensor

from kernels import launch
from kernels.activations import act_bwd
from kernels.gemm_tuning import input_precision, m_bucket
from kernels.launch import INTERPRETED, aligned_width, leading_columns, new_padded, rows_contiguous
from kernels.linear_act_dw import linear_act_dw
from kernels.linear_act_forward import SAVES_Y, check_inputs
from kernels.partials import row_programs, sum_partials

__all__ = ["check_bwd_inputs", "gemm_grads", "grad_input", "launch_bwd", "linear_act_bwd", "linear_act_dz"]


# M (the batch) changes between calls: do not specialize on it (a new batch size reuses the compiled kernel).
@triton.jit(do_not_specialize=["M"])
def _linear_act_dz_kernel(
    # pointers
    dy_ptr,  # [M, N] gradient of y
    s_ptr,  # [M, N] saved y (relu, sigmoid) or z (gelu_tanh, silu); dy for identity (not read)
    dz_ptr,  # [M, N] output dz, x's dtype
    db_part_ptr,  # [P, N] fp32 partial column sums of dz (HAS_BIAS), P programs along M
    # sizes
    M,
    N,
    # strides (rows; the column stride is 1)
    stride_dym,
    stride_sm,
    stride_dzm,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dz = dy * act'(.) and the bias gradient's partial sums: the prologue of the cuBLAS backward
    (``_linear_act_bwd_cublas``). Program (p, c) loops over row blocks p, p + P, ... (P programs along M)
    and writes its column sums to row p of the partials (summed over the tile's rows once, after the loop:
    no cross-warp reduction per row block)."""
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for block in range(pid_m, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if ACTIVATION == "identity":
            dz = dy
        else:
            s_ptrs = s_ptr + rows[:, None] * stride_sm + cols[None, :]
            dz = act_bwd(dy, tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32), ACTIVATION)
        dz_ptrs = dz_ptr + rows[:, None] * stride_dzm + cols[None, :]
        tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            db_acc += tl.where(mask, dz, 0.0)
    if HAS_BIAS:
        tl.store(db_part_ptr + pid_m * N + cols, tl.sum(db_acc, axis=0), mask=cols < N)


def _check_like(name: str, t: Tensor | None, shape: tuple[int, ...], x: Tensor) -> None:
    if t is None or tuple(t.shape) != tuple(shape) or t.dtype != x.dtype or t.device != x.device:
        got = "None" if t is None else f"({tuple(t.shape)}, {t.dtype}, {t.device})"
        raise ValueError(f"linear_act: {name} must be ({tuple(shape)}, {x.dtype}, {x.device}), got {got}")


def check_bwd_inputs(
    dy: Tensor, x: Tensor, weight: Tensor, saved: Tensor | None, activation: str, has_bias: bool
) -> None:
    check_inputs(x, weight, None, activation)
    if not isinstance(has_bias, bool):
        raise ValueError(f"linear_act: has_bias must be a bool, got {has_bias!r}")
    shape = (x.shape[0], weight.shape[0])
    _check_like("dy", dy, shape, x)
    if activation != "identity":
        what = "y" if activation in SAVES_Y else "z"
        _check_like(f"saved (the forward's {what} for {activation!r})", saved, shape, x)


def linear_act_bwd(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    saved: Tensor | None,
    activation: str,
    has_bias: bool,
    needs_dx: bool = True,
    method: str = "auto",
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """The backward: ``dz = dy * act'``, ``dx = dz @ W``, ``dW = dz^T @ x``, ``db`` (module docstring).

    Args:
        dy: [M, N] gradient of y, x's dtype and device.
        x: [M, K] saved forward input, fp32/bf16/fp16.
        weight: [N, K] saved weight, x's dtype and device.
        saved: the second output of ``linear_act_fwd`` (None or ignored for identity; y for relu and
            sigmoid; z for gelu_tanh and silu): [M, N], x's dtype and device.
        activation: one of ``ACTIVATIONS``, as in the forward.
        has_bias: whether to return db (the forward had a bias).
        needs_dx: whether to compute dx; False skips its GEMM (e.g. the first layer, whose input needs
            no gradient).
        method: "cublas" (a Triton dz + db kernel, then cuBLAS GEMMs), "triton" (dW and db by the Triton
            dW kernel with dz fused into its loads; only with needs_dx=False) or "auto": "cublas" when dx
            is needed, else the faster of the two for this shape, timed once per (M bucket, N, K, dtype,
            GEMM precision, activation, bias) on the GPU and remembered; "triton" in the interpreter.

    Returns:
        (dx, dw, db): dx [M, K] (None unless needs_dx; rows padded to 16 bytes, as ``new_padded`` makes
        them), dw [N, K], db [N] (None unless has_bias), all in x's dtype; dw and db are zeros when M == 0.

    Raises:
        ValueError: bad shapes, dtypes, devices or activation, a missing ``saved``, an unknown method, or
            method "triton" with needs_dx.
    """
    check_bwd_inputs(dy, x, weight, saved, activation, has_bias)
    if method not in ("auto", "triton", "cublas"):
        raise ValueError(f"unknown backward method {method!r}: expected 'auto', 'triton' or 'cublas'")
    if method == "triton" and needs_dx:
        raise ValueError(
            "backward method 'triton' computes dW and db only: it needs needs_dx=False, got True"
        )
    if method == "auto":
        return launch_bwd(dy, x, weight, saved, activation, has_bias, needs_dx)
    if method == "triton":
        return None, *linear_act_dw(dy, x, saved, activation, has_bias)
    return _linear_act_bwd_cublas(dy, x, weight, saved, activation, has_bias, needs_dx)


def launch_bwd(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    saved: Tensor | None,
    activation: str,
    has_bias: bool,
    needs_dx: bool,
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """``linear_act_bwd`` with method "auto" and without its input checks, for the autograd op, whose
    backward inputs are its own forward's: host time that every launch from Python pays."""
    if needs_dx or _pick_backward(dy, x, weight, saved, activation, has_bias) == "cublas":
        return _linear_act_bwd_cublas(dy, x, weight, saved, activation, has_bias, needs_dx)
    return None, *linear_act_dw(dy, x, saved, activation, has_bias)


# The backward implementation chosen per (M bucket, N, K, dtype, GEMM precision, activation, bias), for
# layers whose dx is not needed.
_BACKWARD_CHOICE: dict[tuple, str] = {}


def _pick_backward(dy, x, weight, saved, activation, has_bias) -> str:
    """The faster dW + db backward for this shape (no dx): both are timed (median of CUDA-event timings) the
    first time a shape is seen. "triton" saves the [M, N] dz pass; cuBLAS's GEMM may still win (module
    docstring: tf32 Triton 0.61-0.70x cuBLAS's time on 13 -> 512, bf16 1.0-1.23x). Inside a CUDA graph
    capture nothing can be timed: an unseen shape then takes "triton". The interpreter times nothing either
    and takes "triton", so the CPU tests run the dW kernel through the autograd op too."""
    if INTERPRETED:
        return "triton"
    key = (m_bucket(x.shape[0]), weight.shape[0], x.shape[1], x.dtype, input_precision(x.dtype), activation,
           has_bias)  # fmt: skip
    if key not in _BACKWARD_CHOICE:
        if torch.cuda.is_current_stream_capturing():
            return "triton"
        candidates = {
            "triton": lambda: linear_act_dw(dy, x, saved, activation, has_bias),
            "cublas": lambda: _linear_act_bwd_cublas(dy, x, weight, saved, activation, has_bias, False),
        }
        times = {name: _graph_time(fn) for name, fn in candidates.items()}
        _BACKWARD_CHOICE[key] = min(times, key=times.get)
    return _BACKWARD_CHOICE[key]


def _graph_time(fn) -> float:
    """Median ms of `fn()` replayed as a CUDA graph: the GPU time a graph-captured step pays. Timed as
    launched from Python instead, host overhead would decide the choice for small layers, differently run to
    run."""
    fn()  # autotuning and lazy initialization, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=40, return_mode="median")
    del graph
    return ms


def linear_act_dz(
    dy: Tensor, saved: Tensor | None, activation: str, has_bias: bool, dtype: torch.dtype
) -> tuple[Tensor, Tensor | None]:
    """dz = dy * act' [M, N] (rounded to `dtype`) and, with has_bias, db = its column sums [N] (`dtype`), in
    one Triton pass over [M, N] (``_linear_act_dz_kernel``) and a sum of its fp32 partials; `saved` is the
    forward's y (relu, sigmoid) or z (gelu_tanh, silu), not read for identity. M >= 1. Also the first step
    of other ops' backwards (kernels/lora_linear.py)."""
    m, n = dy.shape
    dy = rows_contiguous(dy)
    s = rows_contiguous(saved) if activation != "identity" else dy
    dz = launch.empty((m, n), dtype, dy.device)
    block_n = min(128, triton.next_power_of_2(n))
    block_m = max(16, 4096 // block_n)
    col_tiles = triton.cdiv(n, block_n)
    # About 4 * MAX_PARTIAL_ROWS programs in all, the fastest count for dz and the partials' sum over the
    # layer widths of the shipped configs: narrow layers want more programs along M, N = 512 (4 column
    # tiles) fewer.
    grid = (row_programs(m, block_m, max(1, 4 // col_tiles)), col_tiles)
    db_part = launch.empty((grid[0], n), torch.float32, dy.device) if has_bias else dz
    _linear_act_dz_kernel[grid](
        dy, s, dz, db_part, m, n, dy.stride(0), s.stride(0), dz.stride(0),
        HAS_BIAS=has_bias, ACTIVATION=activation, BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    return dz, (sum_partials(db_part, dtype) if has_bias else None)


def _rows_padded_to(x: Tensor, kp: int) -> bool:
    """Whether x [M, K]'s rows lie kp apart in a storage that holds all M rows of kp elements."""
    end = (x.storage_offset() + x.shape[0] * kp) * x.element_size()
    return x.stride(0) == kp and x.untyped_storage().nbytes() >= end


def _linear_act_bwd_cublas(dy, x, weight, saved, activation, has_bias, needs_dx):
    """dz and db partials in one Triton pass over [M, N], then dx = dz @ W and dW = dz^T @ x by cuBLAS."""
    m, k = x.shape
    n = weight.shape[0]
    if m == 0:
        db = torch.zeros(n, dtype=x.dtype, device=x.device) if has_bias else None
        return (new_padded(m, k, x) if needs_dx else None), x.new_zeros(n, k), db
    dz, db = linear_act_dz(dy, saved, activation, has_bias, x.dtype)
    dx, dw = gemm_grads(dz, x, weight, needs_dx)
    return dx, dw, db


def gemm_grads(dz: Tensor, x: Tensor, weight: Tensor, needs_dx: bool) -> tuple[Tensor | None, Tensor]:
    """(dx, dW) of ``z = x @ W^T`` by cuBLAS: dx = dz @ W (``grad_input``; None unless needs_dx); dW =
    dz^T @ x [N, K], contiguous. dz [M, N] contiguous, x [M, K] with contiguous rows, W [N, K]; one dtype.
    Shared by the GEMM ops whose backward is cuBLAS's (linear_act, ln_linear_gelu through it, gated_linear),
    each with its own dz."""
    m, k = x.shape
    kp = aligned_width(k, x.dtype)
    dx = grad_input(dz, weight) if needs_dx else None
    # dW [N, K] with K not a multiple of 16 bytes (13 dense features, the 367-wide interaction) makes cuBLAS
    # take its slow align1 kernels, so when x's rows are padded
    # (the op's copy, the interaction's output) the GEMM reads [M, Kp] in place and the extra columns of dW,
    # products with the padding, are dropped.
    if kp != k and _rows_padded_to(x, kp):
        dw = torch.mm(dz.t(), x.as_strided((m, kp), (kp, 1)))[:, :k].contiguous()
    else:
        dw = torch.mm(dz.t(), x)
    return dx, dw


def grad_input(dz: Tensor, weight: Tensor) -> Tensor:
    """dx = dz @ W [M, K] by cuBLAS, in rows padded to 16 bytes where K is not a multiple of 16 bytes (a fresh
    buffer: callers may add to it in place). dz [M, N] contiguous, W [N, K]; one dtype."""
    n, k = weight.shape
    kp = aligned_width(k, weight.dtype)
    # fp32: dz @ W over a contiguous W^T [Kp, N], the reduction dim contiguous in both operands, the only
    # layout that Hopper's TF32 tensor-core kernels take (cuBLAS runs slower sm80 kernels otherwise, even
    # counting the transpose copy). 16-bit GEMMs take W as it is, faster without the copy. Where K is not a
    # multiple of 16 bytes, W^T gets zero rows up to Kp: an aligned GEMM into
    # [M, Kp], whose first K columns are dx.
    if kp == k and weight.dtype != torch.float32:
        return torch.mm(dz, weight)
    if kp == k:
        return torch.mm(dz, weight.t().contiguous().t())
    w_t = weight.new_zeros((kp, n))
    w_t[:k].copy_(weight.t())
    return leading_columns(torch.mm(dz, w_t.t()), k)
