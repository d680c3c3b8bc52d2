"""DLRM dot interaction in one kernel per sample, forward and backward.

Math (FB-DLRM's `interact_features` with self-interaction off; letters of dlrm/model/dlrm.py)
    T = [dense; embedded]               [F+1, D] per sample (row 0 the bottom MLP's output)
    Z = T T^T                           [F+1, F+1]
    out = [dense | Z[i, j] for i > j]   [D + F(F+1)/2], products in row-major strict-lower-triangle order
                                        (torch.tril_indices(F+1, F+1, -1)): Z[1,0], Z[2,0], Z[2,1], ...
                                        product (i, j) at column D + i(i-1)/2 + j
    backward, with G[i, j] = dout[D + pos(max(i,j), min(i,j))] for i != j, G[i, i] = 0 (symmetric):
    dT = G T;   ddense = dT[0] + dout[:D];   dembedded = dT[1:]

Shapes: dense [B, D], embedded [B, F, D], out [B, D + F(F+1)/2] (367 for F = 26, D = 16).
Dtypes: fp32, bf16, fp16 (dense and embedded alike); out and gradients in the input dtype. Compute: fp32
(every value is loaded as fp32, the interpreter needs it for bf16 anyway); the dot products run on TF32
tensor cores on the GPU at the precision of PyTorch's own matmuls (``kernels.gemm.tuning.input_precision``):
fp32 inputs as one "tf32" product where ``torch.backends.cuda.matmul.allow_tf32``, else "tf32x3" (three
products, error ~fp32's); bf16/fp16 inputs one "tf32" product (exact for them); IEEE in the interpreter.
Each program loads a sample's F+1 vectors once and writes its whole output row (the forward's programs
take `SAMPLES` samples in turn, see `_meta`): no bmm, no gather of
the triangle, no concat, and no [B, F+1, F+1] intermediate. Backward saves the inputs (dense, embedded).
The output width is not padded (the top MLP's first layer and its checkpoints stay as in eager), but its
rows are: out is [B, W] with rows 16 bytes apart (367 fp32 values in rows of 368), so the cuBLAS
GEMMs of the top MLP's first layer that read it (dW) and write its gradient run their aligned kernels
rather than the slow align1 ones. The backward takes dout with any row stride.
The PyTorch reference is `dot_interaction_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.gemm.checks import check_dtypes
from kernels.gemm.layout import aligned_width, leading_columns, rows_contiguous
from kernels.gemm.tuning import input_precision
from kernels.launch import INTERPRETED, use_triton
from kernels.op import define_op

__all__ = ["dot_interaction", "dot_interaction_ref", "interaction_width"]


def interaction_width(num_sparse: int, embedding_dim: int) -> int:
    """Output width D + F(F+1)/2 of the dot interaction."""
    return embedding_dim + num_sparse * (num_sparse + 1) // 2


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _load_vectors(dense_ptr, emb_ptr, b, B, F, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """T [BLOCK_T, BLOCK_D] fp32 of sample b: row 0 dense, rows 1..F the embeddings, zero padding (all
    zeros for b >= B)."""
    t = tl.arange(0, BLOCK_T)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    in_d = (d < D) & (b < B)
    dense = tl.load(dense_ptr + b * D + d + t * 0, mask=(t == 0) & in_d, other=0.0)
    emb = tl.load(emb_ptr + (b * F + t - 1) * D + d, mask=(t >= 1) & (t <= F) & in_d, other=0.0)
    return dense.to(tl.float32) + emb.to(tl.float32)


@triton.jit(do_not_specialize=["B"])
def _interaction_fwd_kernel(
    # pointers
    dense_ptr,  # [B, D]
    emb_ptr,  # [B, F, D]
    out_ptr,  # [B, W], W = D + F(F+1)/2, rows stride_out apart
    # sizes
    B,
    F,
    D,
    W,
    stride_out,
    # meta-parameters
    BLOCK_T: tl.constexpr,  # >= F + 1, power of two, >= 16 (tl.dot)
    BLOCK_D: tl.constexpr,  # >= D, power of two, >= 16 (tl.dot)
    SAMPLES: tl.constexpr,  # samples per program, one after the other
    PRECISION: tl.constexpr,  # tl.dot input_precision
):
    i = tl.arange(0, BLOCK_T)[:, None]
    j = tl.arange(0, BLOCK_T)[None, :]
    d = tl.arange(0, BLOCK_D)
    for s in range(SAMPLES):
        b = tl.program_id(0).to(tl.int64) * SAMPLES + s
        vectors = _load_vectors(dense_ptr, emb_ptr, b, B, F, D, BLOCK_T, BLOCK_D)
        z = tl.dot(vectors, tl.trans(vectors), input_precision=PRECISION)
        out_row = out_ptr + b * stride_out
        in_b = b < B
        products = (i > j) & (i <= F) & in_b
        tl.store(out_row + D + i * (i - 1) // 2 + j, z.to(out_ptr.dtype.element_ty), mask=products)
        dense = tl.load(dense_ptr + b * D + d, mask=(d < D) & in_b)
        tl.store(out_row + d, dense, mask=(d < D) & in_b)
        pad = W + tl.arange(0, 8)  # the row's padding up to stride_out (at most 7 values)
        tl.store(
            out_row + pad, tl.zeros((8,), dtype=out_ptr.dtype.element_ty), mask=(pad < stride_out) & in_b
        )


@triton.jit(do_not_specialize=["B"])
def _interaction_bwd_kernel(
    # pointers
    dense_ptr,  # [B, D]
    emb_ptr,  # [B, F, D]
    dout_ptr,  # [B, W], rows stride_dout apart
    ddense_ptr,  # [B, D]
    demb_ptr,  # [B, F, D]
    # sizes
    B,
    F,
    D,
    W,
    stride_dout,
    # meta-parameters
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    vectors = _load_vectors(dense_ptr, emb_ptr, b, B, F, D, BLOCK_T, BLOCK_D)
    i = tl.arange(0, BLOCK_T)[:, None]
    j = tl.arange(0, BLOCK_T)[None, :]
    hi = tl.maximum(i, j)
    lo = tl.minimum(i, j)
    dout_row = dout_ptr + b * stride_dout
    g = tl.load(dout_row + D + hi * (hi - 1) // 2 + lo, mask=(i != j) & (hi <= F), other=0.0).to(tl.float32)
    dvectors = tl.dot(g, vectors, input_precision=PRECISION)  # [BLOCK_T, BLOCK_D]
    d = tl.arange(0, BLOCK_D)[None, :]
    tl.store(
        demb_ptr + (b * F + i - 1) * D + d,
        dvectors.to(demb_ptr.dtype.element_ty),
        mask=(i >= 1) & (i <= F) & (d < D),
    )
    d1 = tl.arange(0, BLOCK_D)
    passthrough = tl.load(dout_row + d1, mask=d1 < D, other=0.0).to(tl.float32)
    ddense = tl.sum(tl.where(i == 0, dvectors, 0.0), axis=0) + passthrough
    tl.store(ddense_ptr + b * D + d1, ddense.to(ddense_ptr.dtype.element_ty), mask=d1 < D)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _check_inputs(dense: Tensor, embedded: Tensor) -> None:
    if dense.ndim != 2 or embedded.ndim != 3:
        raise ValueError(
            f"expected dense [B, D] and embedded [B, F, D], got {list(dense.shape)}, {list(embedded.shape)}"
        )
    if embedded.shape[0] != dense.shape[0] or embedded.shape[2] != dense.shape[1] or dense.shape[1] < 1:
        raise ValueError(
            f"dense {list(dense.shape)} and embedded {list(embedded.shape)} disagree on B or D (D >= 1)"
        )
    check_dtypes("dot_interaction", dense=dense, embedded=embedded)


def _meta(f: int, d: int, dtype: torch.dtype, backward: bool) -> dict:
    """Launch settings. The dot's precision on a GPU is ``input_precision``'s: one TF32 product for 16-bit
    inputs (exact there: their significands fit TF32's 11 bits) and for fp32 under allow_tf32 (the
    precision eager's bmm has then), else "tf32x3" (three TF32 products, about fp32's accuracy, much faster
    than "ieee" FMA dots); the interpreter computes "ieee" fp32 dots anyway. Warps and samples per program
    are the fastest found at the Kaggle shapes (F=26, large B): one sample's tiles are small (32 x D), so
    the forward runs on one or two warps, and where each dot is one product (16-bit, or fp32 TF32 up to
    D=32) 4 samples per program hide the loads' latency; the backward, whose [32, D] fp32 result needs more
    registers, takes one sample per program and four warps past D=32 (one warp with 4 samples per program
    spills there)."""
    meta = {
        "BLOCK_T": max(16, triton.next_power_of_2(f + 1)),
        "BLOCK_D": max(16, triton.next_power_of_2(d)),
        "PRECISION": "ieee" if INTERPRETED else input_precision(dtype),
    }
    if backward:
        return meta | {"num_warps": 1 if d <= 32 else 4}
    samples = 4 if dtype != torch.float32 or (torch.backends.cuda.matmul.allow_tf32 and d <= 32) else 1
    return meta | {"SAMPLES": samples, "num_warps": 1 if dtype != torch.float32 or d <= 32 else 2}


def _new_out(b: int, f: int, d: int, like: Tensor) -> Tensor:
    """The output [B, W] in like's dtype, its rows padded to 16 bytes (W = 367 fp32 -> rows of 368): the
    top MLP's first GEMMs then run aligned (module docstring). Its storage holds all B full rows (the
    forward kernel zeroes the padding), so a GEMM may read it as [B, Wp]."""
    w = interaction_width(f, d)
    return leading_columns(like.new_empty(b, aligned_width(w, like.dtype)), w)


def dot_interaction_fwd(dense: Tensor, embedded: Tensor) -> Tensor:
    """Launch the forward kernel; see `dot_interaction`."""
    _check_inputs(dense, embedded)
    dense, embedded = dense.contiguous(), embedded.contiguous()
    b, f, d = embedded.shape
    out = _new_out(b, f, d, dense)
    if b == 0:
        return out
    meta = _meta(f, d, dense.dtype, backward=False)
    grid = (triton.cdiv(b, meta["SAMPLES"]),)
    _interaction_fwd_kernel[grid](dense, embedded, out, b, f, d, out.shape[1], out.stride(0), **meta)
    return out


def dot_interaction_bwd(dout: Tensor, dense: Tensor, embedded: Tensor) -> tuple[Tensor, Tensor]:
    """Launch the backward kernel: (ddense [B, D], dembedded [B, F, D])."""
    _check_inputs(dense, embedded)
    dense, embedded = dense.contiguous(), embedded.contiguous()
    b, f, d = embedded.shape
    w = interaction_width(f, d)
    if dout.shape != (b, w):
        raise ValueError(f"dout must be [{b}, {w}], got {list(dout.shape)}")
    dout = rows_contiguous(dout)
    ddense, dembedded = torch.empty_like(dense), torch.empty_like(embedded)
    if b == 0:
        return ddense, dembedded
    meta = _meta(f, d, dense.dtype, backward=True)
    args = (dense, embedded, dout, ddense, dembedded, b, f, d, w, dout.stride(0))
    _interaction_bwd_kernel[(b,)](*args, **meta)
    return ddense, dembedded


def dot_interaction_ref(dense: Tensor, embedded: Tensor) -> Tensor:
    """PyTorch reference in fp32 (bmm, triangle gather, concat), cast back to the input dtype."""
    t = torch.cat([dense.unsqueeze(1), embedded], dim=1).float()
    z = torch.bmm(t, t.transpose(1, 2))
    li, lj = torch.tril_indices(t.shape[1], t.shape[1], offset=-1, device=t.device)
    return torch.cat([dense.float(), z[:, li, lj]], dim=1).to(dense.dtype)


def _dot_interaction_bwd_ref(dout: Tensor, dense: Tensor, embedded: Tensor) -> tuple[Tensor, Tensor]:
    """PyTorch backward in fp32, the module docstring's formula: dT = G T with G the symmetric matrix of
    the products' gradients."""
    t = torch.cat([dense.unsqueeze(1), embedded], dim=1).float()
    b, n, d = t.shape
    li, lj = torch.tril_indices(n, n, offset=-1, device=t.device)
    g = t.new_zeros(b, n, n)
    g[:, li, lj] = dout[:, d:].float()
    dt = torch.bmm(g + g.transpose(1, 2), t)
    return (dt[:, 0] + dout[:, :d].float()).to(dense.dtype), dt[:, 1:].to(embedded.dtype)


# --------------------------------------------------------------------------------------------------
# Autograd glue: custom ops for torch.compile; eager calls skip the dispatcher (kernels/op.py)
# --------------------------------------------------------------------------------------------------


def _interaction_impl(dense: Tensor, embedded: Tensor) -> Tensor:
    if use_triton(dense):
        return dot_interaction_fwd(dense, embedded)
    _check_inputs(dense, embedded)
    out = _new_out(*embedded.shape, dense)
    out.as_strided((out.shape[0], out.stride(0)), out.stride()).zero_()
    return out.copy_(dot_interaction_ref(dense, embedded))  # the kernel's layout


def _interaction_fake(dense: Tensor, embedded: Tensor) -> Tensor:
    b, f, d = embedded.shape
    w = interaction_width(f, d)
    return dense.new_empty_strided((b, w), (aligned_width(w, dense.dtype), 1))


def _interaction_backward_impl(dout: Tensor, dense: Tensor, embedded: Tensor) -> tuple[Tensor, Tensor]:
    if use_triton(dense):
        return dot_interaction_bwd(dout, dense, embedded)
    return _dot_interaction_bwd_ref(dout, dense, embedded)


def _interaction_backward_fake(dout: Tensor, dense: Tensor, embedded: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(dense), torch.empty_like(embedded)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(backward_fn, ctx, dout: Tensor):
    dense, embedded = ctx.saved_tensors
    return backward_fn(dout, dense, embedded)


_dot_interaction = define_op(
    "dot_interaction", _interaction_impl, _interaction_fake, _setup_context, _backward,
    _interaction_backward_impl, _interaction_backward_fake,
)  # fmt: skip


def dot_interaction(dense: Tensor, embedded: Tensor) -> Tensor:
    """DLRM dot interaction `[dense | strict lower triangle of T T^T]`, T = [dense; embedded] per sample.

    One Triton kernel forward and one backward on CUDA (and on CPU under TRITON_INTERPRET=1), else the
    PyTorch reference. Differentiable in both inputs; the custom op `torch.ops.dlrm.dot_interaction`.

    Args:
        dense: [B, D] bottom MLP output, fp32/bf16/fp16.
        embedded: [B, F, D] embedding vectors, same dtype and device.
    Returns:
        [B, D + F(F+1)/2] in the input dtype (module docstring gives the column order).
    Raises:
        ValueError: shapes, dtypes or devices that do not match (the message names them).
    """
    return _dot_interaction(dense, embedded)
