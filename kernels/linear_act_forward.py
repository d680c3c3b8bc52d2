"""The forward GEMM of linear_act: ``y = act(x @ W^T + b)`` in one kernel (math, shapes and dtypes in
``kernels/linear_act.py``).

``_linear_act_fwd_kernel``: one program per [BLOCK_M, BLOCK_N] tile of y, taken in groups of GROUP tile rows
(``_grouped_tile``: the programs running together share W tiles in L2), reducing over K in BLOCK_K chunks
loaded through TMA descriptors (``matmul_tile``) with fp32 accumulation; the epilogue adds the bias, stores
z when the backward needs it (``SAVE_Z``) and stores y = act(z). Tiles are autotuned per (M bucket, N, K)
(``kernels.gemm_tuning``).

The launcher ``linear_act_fwd`` validates the op's inputs (``check_inputs``, also used by the autograd op
and the backward) and returns what the backward needs besides x and W: nothing for identity, y for relu and
sigmoid (``SAVES_Y``: act' is a function of y), z for gelu_tanh and silu (``SAVES_Z``).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from kernels import launch
from kernels.activations import act_fwd, check_activation
from kernels.gemm_tuning import autotuned, input_precision, m_bucket
from kernels.launch import DTYPES, INTERPRETED, tma_descriptor

__all__ = ["MATMUL_TILE_DESCRIPTORS", "SAVES_Y", "SAVES_Z", "check_inputs", "linear_act_fwd", "matmul_tile"]

SAVES_Y = ("relu", "sigmoid")  # act' is a function of y = act(z)
SAVES_Z = ("gelu_tanh", "silu")  # act' needs z


@triton.jit
def _grouped_tile(pid, num_pid_a, num_pid_b, GROUP: tl.constexpr):
    """(pid_a, pid_b) of a 1-D program id, in groups of GROUP rows of tiles (L2 reuse of the B operand)."""
    num_pid_in_group = GROUP * num_pid_b
    group_id = pid // num_pid_in_group
    first_pid_a = group_id * GROUP
    group_size = min(num_pid_a - first_pid_a, GROUP)
    pid_a = first_pid_a + (pid % num_pid_in_group) % group_size
    pid_b = (pid % num_pid_in_group) // group_size
    return pid_a, pid_b


@triton.jit
def _dot_chunk(acc, a, b, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """acc + a @ b for one reduction chunk (operands cast to fp32 first in the interpreter)."""
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


# The descriptor arguments of a kernel built on ``matmul_tile`` and the tile dims of their block shapes, which
# must match its loads (``kernels.gemm_tuning.autotuned`` sets them per config).
MATMUL_TILE_DESCRIPTORS = {"x_desc": ("BLOCK_M", "BLOCK_K"), "w_desc": ("BLOCK_N", "BLOCK_K")}


@triton.jit
def matmul_tile(
    x_desc, w_desc, off_m, off_n, K,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The [BLOCK_M, BLOCK_N] fp32 tile of x @ W^T whose first row is off_m and first column off_n, reduced
    over K in BLOCK_K chunks loaded through TMA descriptors (x_desc of x [M, K] in [BLOCK_M, BLOCK_K] blocks,
    w_desc of W [N, K] in [BLOCK_N, BLOCK_K] blocks; ``kernels.launch.tma_descriptor``): rows, columns and
    the K tail past the tensors' ends read 0, with no mask. Inlined into the forward GEMM kernels
    (linear_act, gated_linear), which add their own epilogues.

    Why descriptors: pointer loads need a mask on the K tail where K is not a multiple of BLOCK_K, which
    slows the whole loop on the odd widths the model has (367, 479), and they are no faster where K divides
    evenly. Descriptors are made on the host, which is faster than making them in the kernel and needs no
    per-thread Triton allocator."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = x_desc.load([off_m, k])
        b = w_desc.load([off_n, k])
        acc = _dot_chunk(acc, a, b.T, DOT_FP32, INPUT_PRECISION)
    return acc


# M (the batch) changes between calls: do not specialize on it (value 1 / divisibility by 16), so a new
# batch size reuses the compiled kernel. M_BUCKET only feeds the autotuning key (a power of two >= 64).
@triton.jit(do_not_specialize=["M"])
def _linear_act_fwd_kernel(
    # operands: TMA descriptors (``kernels.launch.tma_descriptor``)
    x_desc,  # of x [M, K], fp32/bf16/fp16
    w_desc,  # of W [N, K], x's dtype
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
    DOT_FP32: tl.constexpr,  # cast dot operands to fp32 (interpreter only)
    INPUT_PRECISION: tl.constexpr,  # fp32 dots: "tf32" or "ieee" (torch's allow_tf32)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # reduction chunk
    GROUP: tl.constexpr,
):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    acc = matmul_tile(
        x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, K,
        DOT_FP32, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip

    # Epilogue: bias, (z), activation, in fp32. int64 row offsets: M * N can pass 2**31.
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    mask = (rows < M)[:, None] & mask_n[None, :]
    if SAVE_Z:
        tl.store(z_ptr + rows[:, None] * stride_zm + cols[None, :], acc.to(z_ptr.dtype.element_ty), mask=mask)
    y = act_fwd(acc, ACTIVATION)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


_linear_act_fwd_kernel = autotuned(
    _linear_act_fwd_kernel,
    ("BLOCK_M", "BLOCK_N", "BLOCK_K"),
    ("M_BUCKET", "N"),
    "y_ptr",
    {"GROUP": 8},
    MATMUL_TILE_DESCRIPTORS,
)


def check_inputs(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> None:
    """Raise ValueError naming the offending values; works on fake tensors too."""
    check_activation("linear_act", activation)
    if x.dim() != 2:
        raise ValueError(f"linear_act: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"linear_act: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"linear_act: weight [N, K] must have K = {x.shape[1]} columns for x of shape {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if x.shape[1] < 1 or weight.shape[0] < 1:
        raise ValueError(
            f"linear_act: need K >= 1 and N >= 1, got x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    if x.dtype not in DTYPES:
        raise ValueError(f"linear_act: x dtype must be one of {DTYPES}, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise ValueError(f"linear_act: weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"linear_act: weight is on {weight.device} but x is on {x.device}")
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            raise ValueError(
                f"linear_act: bias must have shape [N] = [{weight.shape[0]}] for weight of shape "
                f"{tuple(weight.shape)}, got {tuple(bias.shape)}"
            )
        if bias.dtype != x.dtype:
            raise ValueError(f"linear_act: bias dtype {bias.dtype} differs from x dtype {x.dtype}")
        if bias.device != x.device:
            raise ValueError(f"linear_act: bias is on {bias.device} but x is on {x.device}")


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
    check_inputs(x, weight, bias, activation)
    return launch_fwd(x, weight, bias, activation)


def launch_fwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str
) -> tuple[Tensor, Tensor | None]:
    """``linear_act_fwd`` without its input checks, for callers that made them (the autograd op): host time
    that every launch from Python pays."""
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

    _linear_act_fwd_kernel[grid](
        tma_descriptor(x), tma_descriptor(weight), bias if bias is not None else y, y, z if save_z else y,
        m, n, k, m_bucket(m), y.stride(0), (z if save_z else y).stride(0),
        HAS_BIAS=bias is not None, SAVE_Z=save_z, ACTIVATION=activation,
        DOT_FP32=INTERPRETED, INPUT_PRECISION=input_precision(x.dtype),
    )  # fmt: skip
    return y, saved
