"""The forward GEMM of linear_act: ``y = act(x @ W^T + b)`` in one kernel (math, shapes and dtypes in
``kernels/linear_act.py``).

``_linear_act_fwd_kernel``: one program per [BLOCK_M, BLOCK_N] tile of y, taken in groups of GROUP tile rows
(``_grouped_tile``: the programs running together share W tiles in L2), reducing over K in BLOCK_K chunks
with fp32 accumulation; the epilogue adds the bias, stores z when the backward needs it (``SAVE_Z``) and
stores y = act(z). Tiles are autotuned per (M bucket, N, K) (``kernels.gemm_tuning``).

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
from kernels.gemm_tuning import autotuned, even_k, input_precision, m_bucket
from kernels.launch import DTYPES, INTERPRETED, aligned_weight, rows_contiguous

__all__ = ["SAVES_Y", "SAVES_Z", "check_inputs", "linear_act_fwd"]

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


@triton.jit
def matmul_tile(
    x_ptr, w_ptr, rows, cols, mask_m, mask_n, K, stride_xm, stride_wn,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The [BLOCK_M, BLOCK_N] fp32 tile of x @ W^T at `rows` x `cols` (x [M, K] and W [N, K] with row strides
    stride_xm, stride_wn), reduced over K in BLOCK_K chunks; masked rows, columns and the K tail read 0.
    Inlined into the forward GEMM kernels (linear_act, gated_linear), which add their own epilogues.

    Whole chunks load with no mask along K. EVEN_K (K a multiple of BLOCK_K, ``kernels.gemm_tuning.even_k``):
    that is every chunk. Else the K % BLOCK_K tail follows in one masked chunk, rather than a mask along K
    on every chunk, which, K not being a multiple of 16, keeps the loads from being 16 bytes wide. H100,
    M = 16384, 367 -> 512, the best of four tile configs: 44 against 71 us (fp32), 38 against 56 (bf16);
    where K is a multiple of BLOCK_K that tail code, though never run, slowed the loop (bf16 512 -> 512: 36
    against 27 us), hence EVEN_K."""
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols[None, :] * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N] tile of W^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_whole = K if EVEN_K else K - K % BLOCK_K
    for _ in range(0, k_whole, BLOCK_K):
        a = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        b = tl.load(w_ptrs, mask=mask_n[None, :], other=0.0)
        acc = _dot_chunk(acc, a, b, DOT_FP32, INPUT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not EVEN_K and k_whole < K:
        mask_k = ks < K - k_whole
        a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = _dot_chunk(acc, a, b, DOT_FP32, INPUT_PRECISION)
    return acc


# M (the batch) changes between calls: do not specialize on it (value 1 / divisibility by 16), so a new
# batch size reuses the compiled kernel. M_BUCKET only feeds the autotuning key (a power of two >= 64).
@triton.jit(do_not_specialize=["M"])
def _linear_act_fwd_kernel(
    # pointers
    x_ptr,  # [M, K] input, fp32/bf16/fp16
    w_ptr,  # [N, K] weight, x's dtype
    b_ptr,  # [N] bias, x's dtype (not read unless HAS_BIAS)
    y_ptr,  # [M, N] output y = act(z), x's dtype
    z_ptr,  # [M, N] output z = x @ W^T + b, x's dtype (not written unless SAVE_Z)
    # sizes
    M,
    N,
    K,
    M_BUCKET,  # autotuning key only
    # strides (row strides, in elements; the column stride is 1)
    stride_xm,
    stride_wn,
    stride_ym,
    stride_zm,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    SAVE_Z: tl.constexpr,
    ACTIVATION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # cast dot operands to fp32 (interpreter only)
    INPUT_PRECISION: tl.constexpr,  # fp32 dots: "tf32" or "ieee" (torch's allow_tf32)
    EVEN_K: tl.constexpr,  # K is a multiple of BLOCK_K: no mask along K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # reduction chunk
    GROUP: tl.constexpr,
):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    # int64 row offsets: M * K and M * N can pass 2**31.
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rows < M
    mask_n = cols < N
    acc = matmul_tile(
        x_ptr, w_ptr, rows, cols, mask_m, mask_n, K, stride_xm, stride_wn,
        DOT_FP32, INPUT_PRECISION, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip

    # Epilogue: bias, (z), activation, in fp32.
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SAVE_Z:
        tl.store(z_ptr + rows[:, None] * stride_zm + cols[None, :], acc.to(z_ptr.dtype.element_ty), mask=mask)
    y = act_fwd(acc, ACTIVATION)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


_linear_act_fwd_kernel = autotuned(
    _linear_act_fwd_kernel, ("BLOCK_M", "BLOCK_N", "BLOCK_K"), ("M_BUCKET", "N"), "x_ptr", {"GROUP": 8}
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
    x = rows_contiguous(x)
    weight = aligned_weight(weight)
    bias = bias.contiguous() if bias is not None else None

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    _linear_act_fwd_kernel[grid](
        x, weight, bias if bias is not None else x, y, z if save_z else y,
        m, n, k, m_bucket(m),
        x.stride(0), weight.stride(0), y.stride(0), (z if save_z else y).stride(0),
        HAS_BIAS=bias is not None, SAVE_Z=save_z, ACTIVATION=activation,
        DOT_FP32=INTERPRETED, INPUT_PRECISION=input_precision(x.dtype), EVEN_K=even_k(k),
    )  # fmt: skip
    return y, saved
