"""Fused Linear + bias + activation, forward and backward: ``y = act(x @ W^T + b)``.

Math (nn.Linear layout: W is [N, K], one row per output feature)
    z  = x @ W^T + b                 (b broadcast over rows; optional)
    y  = act(z)
    dz = dy * act'(z)
    dx = dz @ W                      [M, K]
    dW = dz^T @ x                    [N, K]
    db = sum over rows of dz         [N]

    act is one of ``ACTIVATIONS`` (identity, relu, sigmoid, gelu_tanh, silu; formulas in
    ``kernels/activations.py``); relu' and sigmoid' are taken from the output y (relu' = [y > 0],
    sigmoid' = y (1 - y)), gelu_tanh' and silu' from the pre-activation z.

Shapes (glossary letters of a GEMM): x [M, K] (M rows, e.g. the batch B; K input features), W [N, K],
b [N] or None, y [M, N]. Any M >= 0, N >= 1, K >= 1 (e.g. K = 13 dense features, N = 1 logit, M = 1).
The kernels take row strides only, and are fast only on rows 16 bytes apart (cuBLAS falls back to its
align1 kernels otherwise; the forward GEMM loads through TMA descriptors, which need them): the autograd op
copies an x whose rows are not (K = 13 dense features, a contiguous [B, 367]) once into rows padded with
zeros to Kp (16 bytes, ``_pads_input``), which the forward GEMM and the backward's dW both read; row-padded
inputs (the dot interaction's output, [B, 367] in rows of 368) are read in place; W is copied into rows of
16 bytes where K is not a multiple of 16 bytes (``kernels.launch.tma_descriptor``). dx comes back with its
rows padded too (cuBLAS writes it as the first K columns of an [M, Kp] GEMM).

Dtypes: x, W and b all fp32, bf16 or fp16 (one dtype); y, dx, dW, db have that dtype.
Compute dtype: fp32 accumulation everywhere. The GEMM operands go to ``tl.dot`` in their own dtype on the
GPU: bf16/fp16 tensor cores; fp32 follows ``torch.backends.cuda.matmul.allow_tf32`` like cuBLAS does:
IEEE fp32 products when it is False (PyTorch's default), TF32 tensor cores (10-bit mantissa operands, fp32
accumulate: a relative error of ~1e-3 per product) when it is True. In the CPU interpreter the operands
are cast to fp32 first (``DOT_FP32``: its bf16 ``dot`` is wrong), so there the GEMM is plain fp32.
Bias, activation and act' run in fp32 on values cast right after load; dz is rounded to the input dtype
before the backward GEMMs (as PyTorch does).

What the forward saves for backward (besides the inputs x and W):
    identity            nothing (act' = 1)
    relu, sigmoid       the output y: relu' = (y > 0), sigmoid' = y (1 - y); no extra tensor is written
    gelu_tanh, silu     the pre-activation z, written by the forward kernel as a second [M, N] output
                        (``SAVE_Z``), since act' cannot be taken from y

Backward (``linear_act_bwd``, ``kernels/linear_act_backward.py``): a Triton pass writes dz = dy * act' and
the bias gradient's partial sums, then cuBLAS computes dx = dz @ W and dW = dz^T @ x. A layer whose input
needs no gradient (the first: K = 13 dense features) may instead take a Triton dW GEMM with dz formed in
registers (``kernels/linear_act_dw.py``), where that is timed faster for its shape; the measurements behind
this choice are in ``kernels/linear_act_backward.py``.

Files: this one holds the op (the custom ops and their autograd glue, ``linear_act``) and its plain-PyTorch
reference; ``kernels/linear_act_forward.py`` the forward kernel and ``linear_act_fwd``;
``kernels/linear_act_backward.py`` the dz kernel, ``linear_act_bwd`` and the choice of backward;
``kernels/linear_act_dw.py`` the Triton dW kernel; ``kernels/gemm_tuning.py`` the autotuning of both GEMM
kernels.

It equals the PyTorch expression ``act(F.linear(x, W, b))`` computed in fp32 and cast back to x's dtype
(see ``linear_act_ref``), up to the GEMM precision above.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from kernels.activations import ACTIVATIONS, act_grad_ref, act_ref
from kernels.direct import call, eager_function
from kernels.launch import (
    aligned_copy,
    has_contiguous_rows,
    padded_like,
    rows_aligned,
    use_triton,
)
from kernels.linear_act_backward import check_bwd_inputs, launch_bwd, linear_act_bwd
from kernels.linear_act_forward import SAVES_Y, SAVES_Z, check_inputs, launch_fwd, linear_act_fwd

__all__ = [
    "ACTIVATIONS",
    "linear_act",
    "linear_act_ref",
    "linear_act_fwd",
    "linear_act_bwd",
]


# --------------------------------------------------------------------------------------------------
# Reference (plain PyTorch, fp32) and CPU fallback
# --------------------------------------------------------------------------------------------------


def linear_act_ref(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    """Reference ``act(F.linear(x, weight, bias))`` in plain PyTorch: fp32 math, cast back to x's dtype.

    Differentiable by autograd (used by the tests for the reference gradients).

    Args:
        x: [M, K] float tensor.
        weight: [N, K] float tensor.
        bias: [N] float tensor or None.
        activation: one of ``ACTIVATIONS``.

    Returns:
        [M, N] tensor of x's dtype.

    Raises:
        ValueError: unknown activation.
    """
    z = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return act_ref(z, activation).to(x.dtype)


def _linear_act_fwd_ref(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str
) -> tuple[Tensor, Tensor | None]:
    """``linear_act_fwd`` in plain PyTorch (fp32 math): the CPU fallback of the forward op."""
    z = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    y = act_ref(z, activation).to(x.dtype)
    if activation in SAVES_Z:
        return y, z.to(x.dtype)
    return y, (y if activation in SAVES_Y else None)


def _linear_act_bwd_ref(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    saved: Tensor | None,
    activation: str,
    has_bias: bool,
    needs_dx: bool,
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """``linear_act_bwd`` in plain PyTorch (fp32 math): the CPU fallback of the backward op.

    Analytic, not torch.autograd.grad: inside a custom op's implementation autograd does not record.
    """
    dy = dy.float()
    s = saved.float() if saved is not None else None
    if activation == "identity":
        dz = dy
    elif activation == "relu":
        dz = torch.where(s > 0, dy, 0.0)
    elif activation == "sigmoid":
        dz = dy * s * (1.0 - s)
    else:  # gelu_tanh, silu: s is z
        dz = dy * act_grad_ref(s, activation)
    dx = (dz @ weight.float()).to(x.dtype) if needs_dx else None
    dw = (dz.t() @ x.float()).to(x.dtype)
    db = dz.sum(dim=0).to(x.dtype) if has_bias else None
    return dx, dw, db


# --------------------------------------------------------------------------------------------------
# Autograd glue: custom ops, so the op works under torch.compile (no tracing into Triton); eager calls
# run the same bodies and formulas without the dispatcher (kernels/direct.py)
# --------------------------------------------------------------------------------------------------


def _pads_input(x: Tensor) -> bool:
    """Whether the autograd op copies x into row-padded rows for its GEMMs: its rows are not contiguous or
    not 16 bytes apart."""
    return not (has_contiguous_rows(x) and rows_aligned(x))


def _forward(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The forward's body: (y, z, x_padded); z is the pre-activation for gelu_tanh/silu, else None;
    x_padded is x copied into rows padded with zeros to 16 bytes where ``_pads_input(x)`` (the x the GEMMs
    read, saved for the backward), else None (x itself is read and saved)."""
    check_inputs(x, weight, bias, activation)
    x_padded = aligned_copy(x) if _pads_input(x) else None
    if use_triton(x):
        y, saved = launch_fwd(x_padded if x_padded is not None else x, weight, bias, activation)
    else:
        y, saved = _linear_act_fwd_ref(x, weight, bias, activation)
    z = saved if activation in SAVES_Z else None
    return y, z, x_padded


def _linear_act_impl(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str
) -> tuple[Tensor, Tensor, Tensor]:
    """The custom op: ``_forward`` with an empty [0] tensor for each None. (Custom-op outputs may not alias
    each other or the inputs, so y is not returned twice for relu/sigmoid nor x as x_padded: the autograd
    glue saves y and x themselves.)"""
    y, z, x_padded = _forward(x, weight, bias, activation)
    z = z if z is not None else x.new_empty((0,))
    x_padded = x_padded if x_padded is not None else x.new_empty((0,))
    return y, z, x_padded


_linear_act_op = torch.library.custom_op("dlrm::linear_act", _linear_act_impl, mutates_args=())


@_linear_act_op.register_fake
def _linear_act_fake(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str
) -> tuple[Tensor, Tensor, Tensor]:
    check_inputs(x, weight, bias, activation)
    shape = (x.shape[0], weight.shape[0])
    x_padded = padded_like(x) if _pads_input(x) else x.new_empty(0)
    return x.new_empty(shape), x.new_empty(shape if activation in SAVES_Z else (0,)), x_padded


def _backward_body(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    saved: Tensor | None,
    activation: str,
    has_bias: bool,
    needs_dx: bool,
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """The backward's body: (dx, dw, db); dx / db are None when needs_dx / has_bias is False. The inputs
    are the forward's own (saved by ``_setup_context``): the Triton path does not check them again."""
    if use_triton(x):
        return launch_bwd(dy, x, weight, saved, activation, has_bias, needs_dx)
    check_bwd_inputs(dy, x, weight, saved, activation, has_bias)
    dx, dw, db = _linear_act_bwd_ref(dy, x, weight, saved, activation, has_bias, needs_dx)
    dx = aligned_copy(dx) if needs_dx else None  # the kernels' layout (see the fake)
    return dx, dw, db


def _linear_act_backward_impl(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    saved: Tensor | None,
    activation: str,
    has_bias: bool,
    needs_dx: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward custom op: ``_backward_body`` with an empty [0] tensor for each None."""
    dx, dw, db = _backward_body(dy, x, weight, saved, activation, has_bias, needs_dx)
    empty = x.new_empty((0,))
    return (dx if dx is not None else empty), dw, (db if db is not None else empty)


_linear_act_backward_op = torch.library.custom_op(
    "dlrm::linear_act_backward", _linear_act_backward_impl, mutates_args=()
)


@_linear_act_backward_op.register_fake
def _linear_act_backward_fake(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    saved: Tensor | None,
    activation: str,
    has_bias: bool,
    needs_dx: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    return (
        padded_like(x) if needs_dx else x.new_empty(0),
        weight.new_empty(weight.shape),
        x.new_empty((weight.shape[0],) if has_bias else (0,)),
    )


def saved_for_backward(
    x: Tensor, weight: Tensor, activation: str, y: Tensor, z: Tensor | None, x_padded: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """What the backward reads, from the forward's inputs and outputs: the x its GEMMs read (x_padded where
    ``_pads_input(x)``, else x itself), W, and y for relu/sigmoid, z for gelu_tanh/silu, None for identity
    (module docstring)."""
    act_input = y if activation in SAVES_Y else (z if activation in SAVES_Z else None)
    return (x_padded if _pads_input(x) else x), weight, act_input


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, activation = inputs
    ctx.save_for_backward(*saved_for_backward(x, weight, activation, *output))
    ctx.activation = activation
    ctx.has_bias = bias is not None


def _backward(backward_fn, ctx, dy: Tensor, _dz: Tensor | None, _dx_padded: Tensor | None):
    # backward_fn: the backward op, or its body on the eager path. _dz, _dx_padded: gradients w.r.t. the
    # internal outputs, which linear_act never exposes (None/zero).
    x, weight, saved = ctx.saved_tensors
    needs_dx = ctx.needs_input_grad[0]  # False for the first layer: its input is data
    dx, dw, db = backward_fn(dy, x, weight, saved, ctx.activation, ctx.has_bias, needs_dx)
    return (dx if needs_dx else None), dw, (db if ctx.has_bias else None), None


_linear_act_op.register_autograd(partial(_backward, _linear_act_backward_op), setup_context=_setup_context)
# Eager calls run the bodies, without the dispatcher and the op's empty placeholders (kernels/direct.py).
_linear_act_eager = eager_function("LinearAct", _forward, _setup_context, partial(_backward, _backward_body))


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def linear_act(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str = "relu") -> Tensor:
    """Fused ``act(x @ weight^T + bias)`` (an nn.Linear plus activation) with a fused backward.

    Equals ``act(F.linear(x, weight, bias))``. Differentiable in x, weight and bias; works in eager and
    under ``torch.compile``, which sees the custom op ``torch.ops.dlrm.linear_act`` (its backward the
    custom op ``torch.ops.dlrm.linear_act_backward``; eager calls skip the dispatcher, kernels/direct.py).
    Runs the Triton kernels on CUDA tensors (and on CPU
    under ``TRITON_INTERPRET=1``), else falls back to plain PyTorch (``linear_act_ref``'s math).

    Args:
        x: [M, K] tensor, fp32, bf16 or fp16 (M >= 0, K >= 1). Copied once into rows padded to 16 bytes
            if its rows are not contiguous or not 16 bytes apart (module docstring).
        weight: [N, K] tensor (nn.Linear layout, N >= 1), same dtype and device as x.
        bias: [N] tensor, same dtype and device as x, or None (no bias).
        activation: one of ``ACTIVATIONS``: "identity", "relu" (default), "sigmoid", "gelu_tanh"
            (``0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))``), "silu" (``z sigmoid(z)``).

    Returns:
        [M, N] tensor of x's dtype: the GEMM accumulated in fp32 (TF32 tensor cores for fp32 inputs on
        the GPU), bias and activation in fp32, rounded once to x's dtype.

    Raises:
        ValueError: x or weight not 2-D, K mismatch, N == 0 or K == 0, bias shape not [N], unknown
            activation, unsupported dtype, dtype mismatch, or tensors on different devices (the message
            names the values).
    """
    y, _, _ = call(_linear_act_op, _linear_act_eager, x, weight, bias, activation)
    return y
