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

Shapes (GEMM letters): x [M, K] (M rows, e.g. the batch B), W [N, K], b [N] or None, y [M, N]; any
M >= 0, N >= 1, K >= 1. The GEMMs are fast only on rows 16 bytes apart (cuBLAS's aligned kernels, TMA
descriptors): an x whose rows are not (K = 13 dense features) is copied once into zero-padded rows
(``_pads_input``), which the forward GEMM and the backward's dW both read; row-padded inputs (the dot
interaction's output) are read in place; dx comes back in rows padded to 16 bytes too.

Dtypes: x, W and b one of fp32, bf16, fp16; y, dx, dW, db the same. fp32 accumulation; the GEMM operands
go to ``tl.dot`` in their own dtype, on tensor cores: fp32 as one TF32 product where PyTorch's matmuls may
use TF32, else as three (3xTF32, about fp32's accuracy; ``kernels.gemm.tuning.input_precision``); plain fp32
in the CPU interpreter (``DOT_FP32``). Bias, activation
and act' in fp32 on values cast right after load; dz is rounded to x's dtype before the backward GEMMs.

Saved for backward besides x and W: nothing for identity; y for relu and sigmoid (``SAVES_Y``); the
pre-activation z, a second output of the forward kernel (``SAVE_Z``), for gelu_tanh and silu (``SAVES_Z``).

Kernel: ``_linear_act_fwd_kernel``, one program per [BLOCK_M, BLOCK_N] tile of y in grouped order, reducing
over K through TMA descriptors (``kernels.gemm.tiles``), autotuned per (M bucket, N, K)
(``kernels.gemm.tuning``); its epilogue adds the bias, stores z if saved and y = act(z) (through TMA
descriptors where N is a multiple of 16 bytes). For relu and
identity, where cuBLAS's GEMM applies the bias and activation itself, each shape takes the faster of the two
(``fastest_fwd``, timed once per shape on the GPU): a small batch's GEMM is a few tiles, which cuBLAS's
kernels may finish sooner.
Backward (``linear_act_bwd``): dz = dy * act' and db in one Triton pass, then cuBLAS's dx and dW
(``kernels.gemm.grads.act_grads``); without dx (the first layer), the Triton dW GEMM with dz in registers
where it is timed faster (``kernels.gemm.dw``). In a stack, layer i's dx GEMM can apply the act' of layer
i - 1 in its epilogue and so hand layer i - 1 its dz and db (``kernels.gemm.dx_act``), where that is timed
faster than the two passes (for the first layer over data, faster than its own backward after cuBLAS's dx
of layer 1).
Autograd: under torch.compile each layer is the custom op ``dlrm::linear_act``; eager calls run the same
bodies in one autograd.Function for a whole stack of layers (``linear_act_stack``, an MLP; ``linear_act``
is a stack of one), so an MLP launched from Python pays the autograd glue once. In a stack's backward on the
GPU at batches of at most ``SIDE_DW_MAX_M`` rows, each layer's cuBLAS dW runs on a second stream
(``kernels.gemm.grads.dw_stream``) beside the chain of dz and dx that the layers below wait for, joined once
at the end: a small batch's GEMMs fill a few SMs each, so the two run side by side.

It equals the PyTorch expression ``act(F.linear(x, W, b))`` computed in fp32 and cast back to x's dtype
(see ``linear_act_ref``), up to the GEMM precision above.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.compiler import is_compiling

from kernels import launch
from kernels.activations import ACTIVATIONS, act_bwd_ref, act_fwd, act_ref, check_activation
from kernels.gemm.checks import check_like, check_linear
from kernels.gemm.dw import act_dw, fastest_dw
from kernels.gemm.dx_act import dx_act, fastest_dx
from kernels.gemm.grads import act_dz, act_grads, dw_stream, gemm_grads, grad_input
from kernels.gemm.layout import (
    aligned_copy,
    describable,
    has_contiguous_rows,
    padded_like,
    rows_aligned,
    tma_descriptor,
)
from kernels.gemm.tiles import MATMUL_TILE_DESCRIPTORS, grouped_tile, linear_tile
from kernels.gemm.tuning import ChoiceTable, autotuned, fastest, input_precision, m_bucket
from kernels.launch import INTERPRETED, use_triton
from kernels.op import define_op

__all__ = [
    "ACTIVATIONS",
    "SAVES_Y",
    "SAVES_Z",
    "launch_fwd",
    "linear_act",
    "linear_act_bwd",
    "linear_act_fwd",
    "linear_act_ref",
    "linear_act_stack",
]

SAVES_Y = ("relu", "sigmoid")  # act' is a function of y = act(z)
SAVES_Z = ("gelu_tanh", "silu")  # act' needs z
# The largest batch at which a stack's backward runs its dW GEMMs on a second stream (module docstring):
# where a step is a chain of latency-bound kernels. Larger GEMMs fill the GPU by themselves.
SIDE_DW_MAX_M = 2048


# -- Kernel ------------------------------------------------------------------------------------------


# M (the batch) changes between calls: do not specialize on it (value 1 / divisibility by 16), so a new
# batch size reuses the compiled kernel. M_BUCKET only feeds the autotuning key (a power of two >= 64).
@triton.jit(do_not_specialize=["M"])
def _linear_act_fwd_kernel(
    # operands: TMA descriptors (``kernels.gemm.layout.tma_descriptor``)
    x_desc,  # of x [M, K], fp32/bf16/fp16
    w_desc,  # of W [N, K], x's dtype
    y_desc,  # TMA_STORE: of y (otherwise any descriptor, not used)
    z_desc,  # TMA_STORE and SAVE_Z: of z (otherwise any descriptor, not used)
    # pointers
    b_ptr,  # [N] bias, x's dtype (not read unless HAS_BIAS)
    y_ptr,  # [M, N] output y = act(z), x's dtype
    z_ptr,  # [M, N] output z = x @ W^T + b, x's dtype (not written unless SAVE_Z)
    # sizes
    M,
    N,
    K,
    M_BUCKET,  # autotuning key only
    # strides (row strides, in elements; the column stride is 1)
    stride_ym,
    stride_zm,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    SAVE_Z: tl.constexpr,
    ACTIVATION: tl.constexpr,
    TMA_STORE: tl.constexpr,  # store y and z through their descriptors (rows 16 bytes apart), else pointers
    DOT_FP32: tl.constexpr,  # cast dot operands to fp32 (interpreter only)
    INPUT_PRECISION: tl.constexpr,  # fp32 dots: "tf32" or "tf32x3" (torch's allow_tf32), "ieee" interpreted
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # reduction chunk
    GROUP: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    acc, rows, cols, mask = linear_tile(
        x_desc, w_desc, b_ptr, pid_m, pid_n, M, N, K,
        HAS_BIAS, DOT_FP32, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    # Epilogue, in fp32: (z), activation. A descriptor's store writes the tile's in-bounds part, from the
    # dot's register layout through shared memory (pointer stores from that layout are 8 bytes wide).
    y = act_fwd(acc, ACTIVATION)
    if TMA_STORE:
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        if SAVE_Z:
            z_desc.store([off_m, off_n], acc.to(z_desc.dtype))
        y_desc.store([off_m, off_n], y.to(y_desc.dtype))
    else:
        if SAVE_Z:
            z_ptrs = z_ptr + rows[:, None] * stride_zm + cols[None, :]
            tl.store(z_ptrs, acc.to(z_ptr.dtype.element_ty), mask=mask)
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


_TILE = ("BLOCK_M", "BLOCK_N")
_FWD_DESCRIPTORS = {**MATMUL_TILE_DESCRIPTORS, "y_desc": _TILE, "z_desc": _TILE}
_linear_act_fwd_kernel = autotuned(_linear_act_fwd_kernel, "y_ptr", {"GROUP": 8}, _FWD_DESCRIPTORS)


# -- Launchers ---------------------------------------------------------------------------------------


def _check_inputs(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> None:
    check_activation("linear_act", activation)
    check_linear("linear_act", x, weight, bias)


def _check_bwd_inputs(
    dy: Tensor, x: Tensor, weight: Tensor, saved: Tensor | None, activation: str, has_bias: bool
) -> None:
    _check_inputs(x, weight, None, activation)
    if not isinstance(has_bias, bool):
        raise ValueError(f"linear_act: has_bias must be a bool, got {has_bias!r}")
    shape = (x.shape[0], weight.shape[0])
    check_like("linear_act", "dy", dy, shape, x)
    if activation != "identity":
        what = "y" if activation in SAVES_Y else "z"
        check_like("linear_act", f"saved (the forward's {what} for {activation!r})", saved, shape, x)


def linear_act_fwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str
) -> tuple[Tensor, Tensor | None]:
    """Launch ``_linear_act_fwd_kernel``: ``y = act(x @ weight^T + bias)``.

    Args:
        x: [M, K] fp32/bf16/fp16.
        weight: [N, K], x's dtype and device.
        bias: [N], x's dtype and device, or None.
        activation: one of ``ACTIVATIONS``.

    Returns:
        (y, saved): y [M, N] in x's dtype; saved is what ``linear_act_bwd`` needs: None for identity, y
        itself for relu and sigmoid, the pre-activation z [M, N] (x's dtype) for gelu_tanh and silu.

    Raises:
        ValueError: bad shapes, dtypes, devices or activation.
    """
    _check_inputs(x, weight, bias, activation)
    return launch_fwd(x, weight, bias, activation)


def launch_fwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str
) -> tuple[Tensor, Tensor | None]:
    """``linear_act_fwd`` without its input checks, for callers that made them (the autograd op): host time
    that every launch from Python pays. Our kernel, or cuBLAS where it is timed faster (``fastest_fwd``)."""
    if fastest_fwd(x, weight, bias, activation) == "cublas":
        return cublas_fwd(x, weight, bias, activation)
    return triton_fwd(x, weight, bias, activation)


# Activations cuBLAS applies in its GEMM's epilogue (torch._addmm_activation): relu, and identity (none).
# The others save z or have no cuBLAS epilogue.
CUBLAS_ACTIVATIONS = ("identity", "relu")
# The forward chosen per (M bucket, N, K, dtype, GEMM precision, activation, bias).
_FORWARD_CHOICE = ChoiceTable("linear_act forward")


def fastest_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> str:
    """ "triton" (``triton_fwd``) or "cublas" (``cublas_fwd``), the faster for this shape, both timed as CUDA
    graphs the first time a shape is seen (a small batch's GEMM is a few tiles, which cuBLAS's kernels may
    finish sooner; a large one gains from our fused epilogue). "triton" for activations
    outside ``CUBLAS_ACTIVATIONS``, for an unseen shape inside a CUDA graph capture (nothing can be timed
    there), and in the interpreter (the CPU tests run our kernel)."""
    if INTERPRETED or activation not in CUBLAS_ACTIVATIONS or x.shape[0] == 0:
        return "triton"
    key = (m_bucket(x.shape[0]), weight.shape[0], x.shape[1], x.dtype, input_precision(x.dtype), activation,
           bias is not None)  # fmt: skip
    candidates = {
        "triton": lambda: triton_fwd(x, weight, bias, activation),
        "cublas": lambda: cublas_fwd(x, weight, bias, activation),
    }
    return fastest(_FORWARD_CHOICE, key, candidates)


def cublas_fwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str
) -> tuple[Tensor, Tensor | None]:
    """``launch_fwd`` by one cuBLAS call (activation in ``CUBLAS_ACTIVATIONS``): addmm with cuBLASLt's
    bias + ReLU epilogue for relu (``torch._addmm_activation``), mm / addmm for identity; at the precision of
    PyTorch's matmuls, as our kernel (``input_precision``). Same outputs as ``triton_fwd``: (y, y for relu,
    None for identity)."""
    w_t = weight.t()
    if activation == "relu":
        y = torch._addmm_activation(bias, x, w_t) if bias is not None else torch.mm(x, w_t).relu_()
        return y, y
    return (torch.addmm(bias, x, w_t) if bias is not None else torch.mm(x, w_t)), None


def triton_fwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str
) -> tuple[Tensor, Tensor | None]:
    """``launch_fwd`` by ``_linear_act_fwd_kernel``."""
    m, k = x.shape
    n = weight.shape[0]
    save_z = activation in SAVES_Z
    y = launch.empty((m, n), x.dtype, x.device)
    z = launch.empty((m, n), x.dtype, x.device) if save_z else None
    saved = z if save_z else (y if activation in SAVES_Y else None)
    if m == 0:
        return y, saved
    bias = bias.contiguous() if bias is not None else None

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    # y and z are fresh contiguous [M, N]: a descriptor can store them where N is a multiple of 16 bytes.
    tma_store = describable(y) and (z is None or describable(z))
    y_desc = tma_descriptor(y if tma_store else weight)  # a placeholder of its own where not stored through
    z_desc = tma_descriptor(z) if tma_store and save_z else y_desc
    _linear_act_fwd_kernel[grid](
        tma_descriptor(x), tma_descriptor(weight), y_desc, z_desc, bias if bias is not None else y, y,
        z if save_z else y, m, n, k, m_bucket(m), y.stride(0), (z if save_z else y).stride(0),
        HAS_BIAS=bias is not None, SAVE_Z=save_z, ACTIVATION=activation, TMA_STORE=tma_store,
        DOT_FP32=INTERPRETED, INPUT_PRECISION=input_precision(x.dtype),
    )  # fmt: skip
    return y, saved


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
    _check_bwd_inputs(dy, x, weight, saved, activation, has_bias)
    if method not in ("auto", "triton", "cublas"):
        raise ValueError(f"unknown backward method {method!r}: expected 'auto', 'triton' or 'cublas'")
    if method == "triton" and needs_dx:
        raise ValueError(
            "backward method 'triton' computes dW and db only: it needs needs_dx=False, got True"
        )
    if method == "auto":
        return launch_bwd(dy, x, weight, saved, activation, has_bias, needs_dx)
    if method == "triton":
        return None, *act_dw(dy, x, saved, activation, has_bias)
    return act_grads(dy, x, weight, saved, activation, has_bias, needs_dx)


def launch_bwd(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    saved: Tensor | None,
    activation: str,
    has_bias: bool,
    needs_dx: bool,
    side: torch.cuda.Stream | None = None,
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """``linear_act_bwd`` with method "auto" and without its input checks, for the autograd op, whose
    backward inputs are its own forward's: host time that every launch from Python pays. With `side`,
    cuBLAS's dW runs on that stream (``kernels.gemm.grads.gemm_grads``: the caller joins it)."""
    if needs_dx or fastest_dw(dy, x, weight, saved, activation, has_bias) == "cublas":
        return act_grads(dy, x, weight, saved, activation, has_bias, needs_dx, side)
    return None, *act_dw(dy, x, saved, activation, has_bias)


# -- Reference (plain PyTorch, fp32) and CPU fallback ------------------------------------------------


def linear_act_ref(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    """Reference ``act(F.linear(x, weight, bias))`` in plain PyTorch: fp32 math, cast back to x's dtype;
    differentiable by autograd (the tests' reference gradients). x [M, K], weight [N, K], bias [N] or None,
    activation one of ``ACTIVATIONS``; returns [M, N] in x's dtype. Raises ValueError: unknown activation.
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


# -- Autograd: the custom ops (torch.compile) and the layer stack (eager), over the same bodies ------


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
    _check_inputs(x, weight, bias, activation)
    x_padded = aligned_copy(x) if _pads_input(x) else None
    if use_triton(x):
        y, saved = launch_fwd(x_padded if x_padded is not None else x, weight, bias, activation)
    else:
        y, saved = _linear_act_fwd_ref(x, weight, bias, activation)
    z = saved if activation in SAVES_Z else None
    return y, z, x_padded


def _forward_fake(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> tuple[Tensor, ...]:
    _check_inputs(x, weight, bias, activation)
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
    _check_bwd_inputs(dy, x, weight, saved, activation, has_bias)
    # The CPU fallback, in plain PyTorch with fp32 math. Analytic, not torch.autograd.grad: autograd does not
    # record inside a custom op's implementation.
    dz = act_bwd_ref(dy, saved, activation)
    # dx in rows padded to 16 bytes, the kernels' layout (see the fake).
    dx = aligned_copy((dz @ weight.float()).to(x.dtype)) if needs_dx else None
    dw = (dz.t() @ x.float()).to(x.dtype)
    db = dz.sum(dim=0).to(x.dtype) if has_bias else None
    return dx, dw, db


def _backward_fake(dy, x, weight, saved, activation, has_bias, needs_dx) -> tuple[Tensor, ...]:
    return (
        padded_like(x) if needs_dx else x.new_empty(0),
        weight.new_empty(weight.shape),
        x.new_empty((weight.shape[0],) if has_bias else (0,)),
    )


def _saved_for_backward(
    x: Tensor, weight: Tensor, activation: str, y: Tensor, z: Tensor | None, x_padded: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """What the backward reads, from the forward's inputs and outputs: the x its GEMMs read (x_padded where
    ``_pads_input(x)``, else x itself), W, and y for relu/sigmoid, z for gelu_tanh/silu, None for identity
    (module docstring)."""
    act_input = y if activation in SAVES_Y else (z if activation in SAVES_Z else None)
    return (x_padded if _pads_input(x) else x), weight, act_input


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, activation = inputs
    ctx.save_for_backward(*_saved_for_backward(x, weight, activation, *output))
    ctx.activation = activation
    ctx.has_bias = bias is not None


def _gradients(backward_fn, ctx, dy: Tensor, _dz: Tensor | None, _dx_padded: Tensor | None):
    # _dz, _dx_padded: gradients w.r.t. the internal outputs, which linear_act never exposes (None/zero).
    x, weight, saved = ctx.saved_tensors
    needs_dx = ctx.needs_input_grad[0]  # False for the first layer: its input is data
    dx, dw, db = backward_fn(dy, x, weight, saved, ctx.activation, ctx.has_bias, needs_dx)
    return (dx if needs_dx else None), dw, (db if ctx.has_bias else None), None


class _LinearActStack(torch.autograd.Function):
    """Inputs: x, the activations (a tuple of str), then W_0, b_0, W_1, b_1, ... (b_i may be None)."""

    @staticmethod
    def forward(ctx, x: Tensor, activations: tuple[str, ...], *params: Tensor | None) -> Tensor:
        ctx.set_materialize_grads(False)
        saved = []
        for i, activation in enumerate(activations):
            weight, bias = params[2 * i], params[2 * i + 1]
            y, z, x_padded = _forward(x, weight, bias, activation)
            saved += _saved_for_backward(x, weight, activation, y, z, x_padded)  # as linear_act saves
            x = y
        ctx.save_for_backward(*saved)
        ctx.activations = activations
        ctx.has_bias = tuple(params[2 * i + 1] is not None for i in range(len(activations)))
        return x

    @staticmethod
    def backward(ctx, dy: Tensor | None):
        n_layers = len(ctx.activations)
        grads: list[Tensor | None] = [None] * (2 * n_layers)
        if dy is None:
            return None, None, *grads
        saved = ctx.saved_tensors
        device, side = dy.device, _side_stream(dy)
        body = _backward_body if side is None else functools.partial(launch_bwd, side=side)
        given = None  # (dz, db) of layer i where layer i + 1's dx kernel made them (kernels.gemm.dx_act)
        for i in reversed(range(n_layers)):
            x, weight, act_input = saved[3 * i : 3 * i + 3]
            activation, has_bias = ctx.activations[i], ctx.has_bias[i]
            needs_dx = i > 0 or ctx.needs_input_grad[0]  # layer 0's input is often data
            below = _fusable_below(ctx, saved, i)
            if given is None and below is None:
                dy, grads[2 * i], grads[2 * i + 1] = body(
                    dy, x, weight, act_input, activation, has_bias, needs_dx
                )
                continue
            dz, grads[2 * i + 1] = given or act_dz(dy, act_input, activation, has_bias, x.dtype)
            fuse = below is not None and _fuses(ctx, saved, i, dz, below) == "fused"
            dy, grads[2 * i] = gemm_grads(dz, x, weight, needs_dx and not fuse, side)
            given = dx_act(dz, weight, *below) if fuse else None
        if side is not None:  # every dW is read after this (the optimizer, a gradient all-reduce)
            torch.cuda.current_stream(device).wait_stream(side)
        return (dy if ctx.needs_input_grad[0] else None), None, *grads


def _fusable_below(ctx, saved: tuple[Tensor | None, ...], i: int) -> tuple[Tensor | None, str, bool] | None:
    """What ``dx_act`` needs of layer i - 1 (its saved y or z, activation, bias) where layer i's dx can make
    layer i - 1's dz (layer i > 0, on the Triton path, a batch of at least one row); else None."""
    x = saved[3 * i]
    if i == 0 or not use_triton(x) or x.shape[0] == 0:
        return None
    return saved[3 * (i - 1) + 2], ctx.activations[i - 1], ctx.has_bias[i - 1]


def _fuses(ctx, saved: tuple[Tensor | None, ...], i: int, dz: Tensor, below: tuple) -> str:
    """Whether layer i's dx makes layer i - 1's dz ("fused") or not ("two-pass"), timed per shape: by
    ``fastest_dx`` where layer i - 1 needs its own dx, else by ``_fastest_first`` (an MLP's first layer
    over data, whose backward without dx has a Triton path of its own). `below`: ``_fusable_below``'s."""
    if i > 1 or ctx.needs_input_grad[0]:
        return fastest_dx(dz, saved[3 * i + 1], *below)
    return _fastest_first(dz, saved[3 * i + 1], saved[0], saved[1], *below)


# An MLP's first layer over data, from layer 1's dz: the path chosen per (M bucket, W_1's shape, W_0's
# shape, dtype, GEMM precision, activation, bias).
_FIRST_CHOICE = ChoiceTable("first layer from dx with act'")


def _fastest_first(
    dz: Tensor, weight: Tensor, x0: Tensor, w0: Tensor, saved0: Tensor | None, act0: str, has_bias0: bool
) -> str:
    """ "fused" (layer 1's ``dx_act`` makes layer 0's dz, then cuBLAS's dW of layer 0) or "two-pass"
    (cuBLAS's dx of layer 1, then layer 0's own backward without dx: ``launch_bwd``, the Triton dW with dz
    in its loads or cuBLAS), the faster for these shapes, both timed as CUDA graphs the first time they
    are seen; "fused" in the interpreter (the CPU tests run our kernels) and for unseen shapes inside a
    CUDA graph capture."""
    if INTERPRETED:
        return "fused"
    key = (m_bucket(dz.shape[0]), *weight.shape, *w0.shape, dz.dtype, input_precision(dz.dtype), act0,
           has_bias0)  # fmt: skip
    candidates = {
        "fused": lambda: gemm_grads(dx_act(dz, weight, saved0, act0, has_bias0)[0], x0, w0, False),
        "two-pass": lambda: launch_bwd(grad_input(dz, weight), x0, w0, saved0, act0, has_bias0, False),
    }
    return fastest(_FIRST_CHOICE, key, candidates)


def _side_stream(dy: Tensor) -> torch.cuda.Stream | None:
    """The stream for a stack backward's dW GEMMs (module docstring): on the GPU, at most SIDE_DW_MAX_M
    rows; None otherwise (everything on the current stream)."""
    if dy.device.type != "cuda" or dy.shape[0] > SIDE_DW_MAX_M:
        return None
    return dw_stream(dy.device)


def _one_layer(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str):
    """The eager path of one layer: a stack of one, with the op's outputs (z and x_padded are internal)."""
    return _LinearActStack.apply(x, (activation,), weight, bias), None, None


# Under torch.compile each layer is the custom op dlrm::linear_act (its backward dlrm::linear_act_backward);
# eager calls run the same bodies in _LinearActStack, one autograd node for all the layers.
_linear_act = define_op(
    "linear_act", _forward, _forward_fake, _setup_context, _gradients, _backward_body, _backward_fake,
    eager=_one_layer,
)  # fmt: skip


# -- Public API --------------------------------------------------------------------------------------


def linear_act(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str = "relu") -> Tensor:
    """Fused ``act(x @ weight^T + bias)`` (an nn.Linear plus activation) with a fused backward.

    Equals ``act(F.linear(x, weight, bias))``. Differentiable in x, weight and bias; works in eager and
    under ``torch.compile``, which sees the custom op ``torch.ops.dlrm.linear_act`` (its backward the
    custom op ``torch.ops.dlrm.linear_act_backward``; eager calls skip the dispatcher, kernels/op.py).
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
    return _linear_act(x, weight, bias, activation)[0]


def linear_act_stack(
    x: Tensor, weights: list[Tensor], biases: list[Tensor | None], activations: list[str]
) -> Tensor:
    """``linear_act`` applied layer after layer (module docstring): one autograd node for the stack.

    Args:
        x: [M, K_0] tensor, fp32, bf16 or fp16.
        weights: per layer [N_i, K_i] (nn.Linear layout), x's dtype and device, K_{i+1} = N_i.
        biases: per layer [N_i] or None.
        activations: per layer one of ``kernels.linear_act.ACTIVATIONS``.

    Returns:
        [M, N_last] tensor of x's dtype, equal to the layer-by-layer ``linear_act`` result.

    Raises:
        ValueError: the three lists differ in length or are empty; or a layer's inputs are bad (as
            ``linear_act`` raises them, naming the values).
    """
    if not (len(weights) == len(biases) == len(activations) > 0):
        raise ValueError(
            f"linear_act_stack: need as many weights, biases and activations, at least one each, got "
            f"{len(weights)}, {len(biases)} and {len(activations)}"
        )
    if is_compiling():
        for weight, bias, activation in zip(weights, biases, activations, strict=True):
            x = _linear_act.op(x, weight, bias, activation)[0]
        return x
    params = [p for pair in zip(weights, biases, strict=True) for p in pair]
    return _LinearActStack.apply(x, tuple(activations), *params)
