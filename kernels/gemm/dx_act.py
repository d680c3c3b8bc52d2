"""The input gradient of a GEMM layer with the next layer down's act' in its epilogue.

For two stacked layers of an MLP, ``y_{i-1} = act_{i-1}(x_{i-1} @ W_{i-1}^T + b_{i-1})`` and
``y_i = act_i(y_{i-1} @ W_i^T + b_i)``, the backward of layer i computes dx_i = dz_i @ W_i, which is dy_{i-1},
and layer i-1 then makes dz_{i-1} = dy_{i-1} * act_{i-1}' and db_{i-1} from it (``kernels.gemm.grads``: a
cuBLAS GEMM writes dy_{i-1}, the dz pass reads it back with the saved y or z and writes dz_{i-1}). Here one
Triton GEMM does both:

    dz_{i-1} = (dz_i @ W_i) * act_{i-1}'     [M, K]   (K = N_{i-1}, the width of layer i's input)
    db_{i-1} = sum over rows of dz_{i-1}    [K]

so dy_{i-1} never goes to memory: per layer 2 * M * K elements less traffic. act' comes from what the
forward of layer i-1 saved (y for relu and sigmoid, z for gelu_tanh and silu; ``kernels.activations``).
dz_{i-1} is rounded once to the operands' dtype (the two-pass path rounds dy_{i-1} first, then dz_{i-1}); db
sums dz_{i-1} in fp32 before that rounding, as the dz pass does.

Kernel: ``_dx_act_kernel``, the tiles of ``kernels.gemm.tiles`` over dz_i (through a TMA descriptor) and a
contiguous copy of W_i^T (the operand layout Hopper's TF32 tensor-core instructions take: the reduction dim,
N_i, contiguous), autotuned per (M bucket, K, N_i) like the forward (``kernels.gemm.tuning``). Its epilogue
loads the saved y or z and stores dz_{i-1} through TMA descriptors and, for the bias, writes the tile's
column sums as an fp32 partial row (one row in ``DB_ROWS`` of the tile's rows; zeros in the others), summed
by ``kernels.gemm.partials.sum_partials``: no atomics, the same db run to run.
Which of the two paths a shape takes is timed once per shape (``fastest_dx``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import launch
from kernels.activations import act_bwd
from kernels.gemm.grads import act_dz, grad_input
from kernels.gemm.layout import new_padded, tma_descriptor
from kernels.gemm.partials import sum_partials
from kernels.gemm.tiles import MATMUL_TILE_DESCRIPTORS, grouped_tile, matmul_tile
from kernels.gemm.tuning import ChoiceTable, autotuned, fastest, input_precision, m_bucket
from kernels.launch import INTERPRETED

__all__ = ["DB_ROWS", "dx_act", "dx_act_two_pass", "fastest_dx"]

# The rows of one bias-gradient partial: the smallest tile height of the kernel's configs (32 in the
# interpreter, 64 on the GPU: ``kernels.gemm.tuning``), which divides every config's BLOCK_M, so the partials'
# count, cdiv(M, DB_ROWS), does not depend on the config the autotuner picks.
DB_ROWS = 32 if INTERPRETED else 64


# M (the batch) changes between calls: do not specialize on it (a new batch size reuses the compiled kernel).
@triton.jit(do_not_specialize=["M"])
def _dx_act_kernel(
    # TMA descriptors (``kernels.gemm.layout.tma_descriptor``)
    x_desc,  # of dz_i [M, K_red] (K_red = N_i, the reduction), fp32/bf16/fp16
    w_desc,  # of W_i^T [N, K_red] contiguous (N = K_i, the output width), dz_i's dtype
    s_desc,  # of [M, N] layer i-1's saved y (relu, sigmoid) or z (gelu_tanh, silu); unread for identity
    dz_desc,  # of [M, N] the output dz_{i-1}, dz_i's dtype
    # pointers
    db_part_ptr,  # [cdiv(M, DB_ROWS), N] fp32 partial column sums of dz_{i-1} (HAS_BIAS)
    # sizes
    M,
    N,
    K,
    M_BUCKET,  # autotuning key only
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    DB_ROWS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # cast dot operands to fp32 (interpreter only)
    INPUT_PRECISION: tl.constexpr,  # fp32 dots: "tf32" or "tf32x3" (torch's allow_tf32), "ieee" interpreted
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # reduction chunk
    GROUP: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    dy = matmul_tile(x_desc, w_desc, off_m, off_n, K, DOT_FP32, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    # Epilogue, in fp32: act' of layer i-1, then dz_{i-1} and its column sums. Rows and columns past the
    # ends are 0 in dy (the descriptors read 0 there) and so in dz: no mask, and the descriptor's store
    # writes only the in-bounds part.
    if ACTIVATION == "identity":
        dz = dy
    else:
        dz = act_bwd(dy, s_desc.load([off_m, off_n]).to(tl.float32), ACTIVATION)
    dz_desc.store([off_m, off_n], dz.to(dz_desc.dtype))
    if HAS_BIAS:
        # The tile's sums go to the first partial row of its BLOCK_M // DB_ROWS, zeros to the others.
        groups = tl.arange(0, BLOCK_M // DB_ROWS)
        sums = tl.where(groups[:, None] == 0, tl.sum(dz, axis=0)[None, :], 0.0)
        part_rows = pid_m.to(tl.int64) * (BLOCK_M // DB_ROWS) + groups
        cols = off_n + tl.arange(0, BLOCK_N)
        part_mask = (part_rows < tl.cdiv(M, DB_ROWS))[:, None] & (cols < N)[None, :]
        tl.store(db_part_ptr + part_rows[:, None] * N + cols[None, :], sums, mask=part_mask)


_TILE = ("BLOCK_M", "BLOCK_N")
_DESCRIPTORS = {**MATMUL_TILE_DESCRIPTORS, "s_desc": _TILE, "dz_desc": _TILE}
_dx_act_kernel = autotuned(_dx_act_kernel, "dz_desc", {"GROUP": 8}, _DESCRIPTORS)


def dx_act(
    dz: Tensor, weight: Tensor, saved: Tensor | None, activation: str, has_bias: bool
) -> tuple[Tensor, Tensor | None]:
    """dz_{i-1} = (dz_i @ W_i) * act_{i-1}' and db_{i-1} (module docstring) by ``_dx_act_kernel``.

    Args:
        dz: [M, N_i] dz of layer i with contiguous rows, M >= 1; fp32, bf16 or fp16.
        weight: [N_i, K] W_i, dz's dtype and device.
        saved: [M, K] what layer i-1's forward saved for act' (y for relu and sigmoid, z for gelu_tanh and
            silu; ``kernels.linear_act``), dz's dtype, contiguous rows; None for identity.
        activation: layer i-1's activation, one of ``kernels.activations.ACTIVATIONS``.
        has_bias: whether layer i-1 has a bias (return db_{i-1}).

    Returns:
        (dz_{i-1}, db_{i-1}): [M, K] in rows padded to 16 bytes (``new_padded``) and [K] (None unless
        has_bias), both in dz's dtype. The launcher of the stack's backward checked the inputs (they are its
        forward's own).
    """
    m = dz.shape[0]
    k = weight.shape[1]
    out = new_padded(m, k, dz)
    db_part = launch.empty((triton.cdiv(m, DB_ROWS), k), torch.float32, dz.device) if has_bias else dz
    out_desc = tma_descriptor(out)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(k, meta["BLOCK_N"]),)

    _dx_act_kernel[grid](
        tma_descriptor(dz), tma_descriptor(weight.t().contiguous()),
        out_desc if activation == "identity" else tma_descriptor(saved), out_desc, db_part,
        m, k, dz.shape[1], m_bucket(m),
        HAS_BIAS=has_bias, ACTIVATION=activation, DB_ROWS=DB_ROWS,
        DOT_FP32=INTERPRETED, INPUT_PRECISION=input_precision(dz.dtype),
    )  # fmt: skip
    return out, (sum_partials(db_part, dz.dtype) if has_bias else None)


def dx_act_two_pass(
    dz: Tensor, weight: Tensor, saved: Tensor | None, activation: str, has_bias: bool
) -> tuple[Tensor, Tensor | None]:
    """The two-pass path ``dx_act`` replaces: cuBLAS's dx_i = dz_i @ W_i (``grad_input``), then the dz pass of
    layer i-1 (``act_dz``). Same arguments and returns as ``dx_act``."""
    return act_dz(grad_input(dz, weight), saved, activation, has_bias, dz.dtype)


# The path chosen per (M bucket, N_i, K, dtype, GEMM precision, activation, bias).
_DX_CHOICE = ChoiceTable("dx with act'")


def fastest_dx(dz: Tensor, weight: Tensor, saved: Tensor | None, activation: str, has_bias: bool) -> str:
    """ "fused" (``dx_act``) or "two-pass" (``dx_act_two_pass``), the faster for this shape, both timed as
    CUDA graphs the first time a shape is seen (at a small batch cuBLAS's GEMM may finish sooner than our
    kernel saves); "fused" in the interpreter (the CPU tests run our kernel) and for an unseen shape inside
    a CUDA graph capture."""
    if INTERPRETED:
        return "fused"
    key = (m_bucket(dz.shape[0]), *weight.shape, dz.dtype, input_precision(dz.dtype), activation, has_bias)
    candidates = {
        "fused": lambda: dx_act(dz, weight, saved, activation, has_bias),
        "two-pass": lambda: dx_act_two_pass(dz, weight, saved, activation, has_bias),
    }
    return fastest(_DX_CHOICE, key, candidates)
