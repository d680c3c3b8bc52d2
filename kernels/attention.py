"""Multi-head self-attention over a short sequence with a key-validity mask, one kernel per direction:
``o = softmax(q k^T / sqrt(d) + mask) v``.

Math (per sample b and head h; S positions, d features per head; valid[b, j] says whether key j takes part)
    s    = q k^T / sqrt(d)                                  [S, S]
    p    = softmax over the valid keys j of s[i, j]         (p[i, j] = 0 where key j is not valid)
    o    = p v                                              [S, d]
    lse  = log sum over the valid keys of exp(s[i, j])      [S] (saved for the backward)
    backward, from p recomputed as exp(s - lse):
    dv   = p^T do;   dp = do v^T;   delta_i = sum_c do[i, c] o[i, c]
    ds   = p (dp - delta);   dq = ds k / sqrt(d);   dk = ds^T q / sqrt(d)
    A query row with no valid key gets o = 0 and zero gradients (F.scaled_dot_product_attention would give
    NaN there); the DLRM attention interaction never has one, its dense vector is always a valid key.

Shapes (F.scaled_dot_product_attention's layout): q, k, v [B, H, S, d] with any strides but a unit stride
along d (e.g. views of one [B, S, 3, H, d] projection); valid [B, S] bool. Made for DLRM's S = F + 1 = 27
feature vectors: one program per (sample, head) holds the whole S x S tile (S <= 128, d <= 256). o, dq, dk
and dv are [B, H, S, d] laid out as [B, S, H, d] in memory (strides (S H d, d, H d, 1)), so
``o.transpose(1, 2).reshape(B, S, H * d)``, the next layer's input, is a view.

Dtypes: q, k, v fp32, bf16 or fp16 (one dtype); o, dq, dk, dv in that dtype; lse fp32. Compute: fp32 on
values cast right after load; the four products run as ``tl.dot`` in fp32 on the GPU's tensor cores: one
TF32 product for 16-bit inputs, and for fp32 inputs exactly when ``torch.backends.cuda.matmul.allow_tf32``,
else three (3xTF32, about fp32's accuracy; ``kernels.gemm.tuning.input_precision``); plain fp32 in the
interpreter. Softmax with the row maximum subtracted. Backward saves q, k, v, o, lse (and valid).

It equals ``F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])`` computed in fp32
(``masked_attention_ref``), for rows with at least one valid key.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.gemm.tuning import input_precision
from kernels.launch import DTYPES, INTERPRETED, use_triton
from kernels.op import define_op

__all__ = ["masked_attention", "masked_attention_ref", "masked_attention_fwd", "masked_attention_bwd"]

MAX_S, MAX_D = 128, 256


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _load_tile(ptr, stride_s, S, D, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """[BLOCK_S, BLOCK_D] fp32 tile of one (sample, head), zeros past S and d."""
    s = tl.arange(0, BLOCK_S)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    return tl.load(ptr + s * stride_s + d, mask=(s < S) & (d < D), other=0.0).to(tl.float32)


@triton.jit
def _store_tile(ptr, stride_s, value, S, D, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.arange(0, BLOCK_S)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    tl.store(ptr + s * stride_s + d, value.to(ptr.dtype.element_ty), mask=(s < S) & (d < D))


@triton.jit(do_not_specialize=["B"])
def _attention_fwd_kernel(
    # pointers
    q_ptr,  # [B, H, S, D]
    k_ptr,  # [B, H, S, D]
    v_ptr,  # [B, H, S, D]
    valid_ptr,  # [B, S] uint8 (bool): key j of sample b takes part
    o_ptr,  # [B, H, S, D] output
    lse_ptr,  # [B, H, S] fp32 output, contiguous
    # sizes
    B,
    H,
    S,
    D,
    scale,  # 1 / sqrt(D)
    # strides (in elements; the stride along D is 1), per tensor: sample, head, position
    stride_qb,
    stride_qh,
    stride_qs,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_ob,
    stride_oh,
    stride_os,
    # meta-parameters
    PRECISION: tl.constexpr,  # tl.dot input_precision
    BLOCK_S: tl.constexpr,  # >= S, power of two, >= 16
    BLOCK_D: tl.constexpr,  # >= D, power of two, >= 16
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // H
    h = pid % H
    q = _load_tile(q_ptr + b * stride_qb + h * stride_qh, stride_qs, S, D, BLOCK_S, BLOCK_D)
    k = _load_tile(k_ptr + b * stride_kb + h * stride_kh, stride_ks, S, D, BLOCK_S, BLOCK_D)
    v = _load_tile(v_ptr + b * stride_vb + h * stride_vh, stride_vs, S, D, BLOCK_S, BLOCK_D)
    j = tl.arange(0, BLOCK_S)
    key_ok = (tl.load(valid_ptr + b * S + j, mask=j < S, other=0) != 0)[None, :]

    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_S, BLOCK_S]
    m = tl.max(tl.where(key_ok, scores, -1e30), axis=1)
    p = tl.where(key_ok, tl.exp(scores - m[:, None]), 0.0)
    total = tl.sum(p, axis=1)
    total = tl.where(total > 0.0, total, 1.0)  # no valid key: p = 0, o = 0
    o = tl.dot(p / total[:, None], v, input_precision=PRECISION)
    _store_tile(o_ptr + b * stride_ob + h * stride_oh, stride_os, o, S, D, BLOCK_S, BLOCK_D)
    i = tl.arange(0, BLOCK_S)
    tl.store(lse_ptr + pid * S + i, m + tl.log(total), mask=i < S)


@triton.jit(do_not_specialize=["B"])
def _attention_bwd_kernel(
    # pointers
    q_ptr,  # [B, H, S, D] saved inputs
    k_ptr,
    v_ptr,
    o_ptr,  # [B, H, S, D] saved output
    do_ptr,  # [B, H, S, D] gradient of o
    valid_ptr,  # [B, S] uint8
    lse_ptr,  # [B, H, S] fp32
    dq_ptr,  # [B, H, S, D] outputs (strides of o)
    dk_ptr,
    dv_ptr,
    # sizes
    B,
    H,
    S,
    D,
    scale,
    # strides (sample, head, position; the stride along D is 1)
    stride_qb,
    stride_qh,
    stride_qs,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_ob,  # o, dq, dk, dv
    stride_oh,
    stride_os,
    stride_dob,
    stride_doh,
    stride_dos,
    # meta-parameters
    PRECISION: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // H
    h = pid % H
    q = _load_tile(q_ptr + b * stride_qb + h * stride_qh, stride_qs, S, D, BLOCK_S, BLOCK_D)
    k = _load_tile(k_ptr + b * stride_kb + h * stride_kh, stride_ks, S, D, BLOCK_S, BLOCK_D)
    v = _load_tile(v_ptr + b * stride_vb + h * stride_vh, stride_vs, S, D, BLOCK_S, BLOCK_D)
    o_off = b * stride_ob + h * stride_oh
    o = _load_tile(o_ptr + o_off, stride_os, S, D, BLOCK_S, BLOCK_D)
    do = _load_tile(do_ptr + b * stride_dob + h * stride_doh, stride_dos, S, D, BLOCK_S, BLOCK_D)
    j = tl.arange(0, BLOCK_S)
    key_ok = (tl.load(valid_ptr + b * S + j, mask=j < S, other=0) != 0)[None, :]
    lse = tl.load(lse_ptr + pid * S + j, mask=j < S, other=0.0)

    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    p = tl.where(key_ok, tl.exp(scores - lse[:, None]), 0.0)  # rows past S: do = 0, no contribution
    dv = tl.dot(tl.trans(p), do, input_precision=PRECISION)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    delta = tl.sum(do * o, axis=1)
    ds = p * (dp - delta[:, None]) * scale
    dq = tl.dot(ds, k, input_precision=PRECISION)
    dk = tl.dot(tl.trans(ds), q, input_precision=PRECISION)
    _store_tile(dq_ptr + o_off, stride_os, dq, S, D, BLOCK_S, BLOCK_D)
    _store_tile(dk_ptr + o_off, stride_os, dk, S, D, BLOCK_S, BLOCK_D)
    _store_tile(dv_ptr + o_off, stride_os, dv, S, D, BLOCK_S, BLOCK_D)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, valid: Tensor) -> None:
    """Raise ValueError naming the offending values; works on fake tensors too."""
    if q.dim() != 4 or tuple(k.shape) != tuple(q.shape) or tuple(v.shape) != tuple(q.shape):
        raise ValueError(
            f"masked_attention: q, k, v must be [B, H, S, d] of one shape, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, h, s, d = q.shape
    if not (1 <= s <= MAX_S and 1 <= d <= MAX_D and h >= 1):
        raise ValueError(
            f"masked_attention: need 1 <= S <= {MAX_S}, 1 <= d <= {MAX_D}, H >= 1, got q {tuple(q.shape)}"
        )
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"masked_attention: q, k, v dtypes must be one of {DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if tuple(valid.shape) != (b, s) or valid.dtype != torch.bool:
        raise ValueError(
            f"masked_attention: valid must be a [B, S] = [{b}, {s}] bool tensor, got {tuple(valid.shape)} "
            f"{valid.dtype}"
        )
    if len({t.device for t in (q, k, v, valid)}) != 1:
        raise ValueError(
            f"masked_attention: q, k, v, valid on {q.device}, {k.device}, {v.device}, {valid.device}"
        )


def _new_bshd(like: Tensor) -> Tensor:
    """[B, H, S, d] like `like`, laid out as [B, S, H, d] (a tensor of its own over a fresh buffer: set_,
    not a permuted view, since custom-op outputs may have no base)."""
    b, h, s, d = like.shape
    buffer = like.new_empty((b, s, h, d))
    return buffer.new_empty(0).set_(buffer.untyped_storage(), 0, (b, h, s, d), (s * h * d, d, h * d, 1))


def _unit_d(t: Tensor) -> Tensor:
    return t if t.stride(3) == 1 or t.shape[3] == 1 else t.contiguous()


def _meta(s: int, d: int, dtype: torch.dtype) -> dict:
    """Whole-tile blocks; the dot precision ("ieee" in the interpreter, which computes fp32 anyway)."""
    precision = "ieee" if INTERPRETED else input_precision(dtype)
    return {
        "BLOCK_S": max(16, triton.next_power_of_2(s)),
        "BLOCK_D": max(16, triton.next_power_of_2(d)),
        "PRECISION": precision,
        "num_warps": 2 if d <= 32 else 4,
    }


def _strides(t: Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def masked_attention_fwd(q: Tensor, k: Tensor, v: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel: (o [B, H, S, d] laid out as [B, S, H, d], lse [B, H, S] fp32).

    Raises:
        ValueError: bad shapes, dtypes or devices.
    """
    _check_inputs(q, k, v, valid)
    q, k, v = _unit_d(q), _unit_d(k), _unit_d(v)
    b, h, s, d = q.shape
    o = _new_bshd(q)
    lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    if b == 0:
        return o, lse
    _attention_fwd_kernel[(b * h,)](
        q, k, v, valid.contiguous().view(torch.uint8), o, lse, b, h, s, d, 1.0 / math.sqrt(d),
        *_strides(q), *_strides(k), *_strides(v), *_strides(o), **_meta(s, d, q.dtype),
    )  # fmt: skip
    return o, lse


def masked_attention_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, valid: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the backward kernel: (dq, dk, dv), each [B, H, S, d] laid out as [B, S, H, d].

    Raises:
        ValueError: bad shapes, dtypes or devices.
    """
    _check_inputs(q, k, v, valid)
    for name, t in (("do", do), ("o", o)):
        if tuple(t.shape) != tuple(q.shape) or t.dtype != q.dtype:
            raise ValueError(
                f"masked_attention: {name} must be {tuple(q.shape)} {q.dtype}, got {tuple(t.shape)} {t.dtype}"
            )
    q, k, v, o, do = (_unit_d(t) for t in (q, k, v, o, do))
    b, h, s, d = q.shape
    dq, dk, dv = _new_bshd(q), _new_bshd(q), _new_bshd(q)
    if b == 0:
        return dq, dk, dv
    if o.stride() != dq.stride():  # the kernel writes dq, dk, dv with o's strides
        o = _new_bshd(q).copy_(o)
    _attention_bwd_kernel[(b * h,)](
        q, k, v, o, do, valid.contiguous().view(torch.uint8), lse.contiguous(), dq, dk, dv,
        b, h, s, d, 1.0 / math.sqrt(d),
        *_strides(q), *_strides(k), *_strides(v), *_strides(o), *_strides(do), **_meta(s, d, q.dtype),
    )  # fmt: skip
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------
# Reference (plain PyTorch, fp32) and CPU fallback
# --------------------------------------------------------------------------------------------------


def masked_attention_ref(q: Tensor, k: Tensor, v: Tensor, valid: Tensor) -> Tensor:
    """Reference softmax(q k^T / sqrt(d), over the valid keys) v in fp32, cast back to q's dtype; rows with
    no valid key give 0. Differentiable by autograd. Equals
    ``F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])`` where a row has a valid
    key.

    Args:
        q, k, v: [B, H, S, d]; valid: [B, S] bool.

    Returns:
        [B, H, S, d] in q's dtype.
    """
    scores = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    keep = valid[:, None, None, :]
    p = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    p = torch.where(keep.any(-1, keepdim=True), p, 0.0)
    return (p @ v.float()).to(q.dtype)


def _masked_attention_fwd_ref(q, k, v, valid):
    scores = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    keep = valid[:, None, None, :]
    lse = torch.logsumexp(scores.masked_fill(~keep, float("-inf")), dim=-1)
    lse = torch.where(torch.isfinite(lse), lse, -1e30)
    p = torch.where(keep, torch.exp(scores - lse[..., None]), 0.0)
    return _new_bshd(q).copy_(p @ v.float()), lse


def _masked_attention_bwd_ref(do, q, k, v, o, lse, valid):
    """``masked_attention_bwd`` in plain PyTorch (fp32, analytic: autograd does not record in a custom op)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    qf, kf, vf, of, dof = (t.float() for t in (q, k, v, o, do))
    scores = qf @ kf.transpose(-1, -2) * scale
    p = torch.where(valid[:, None, None, :], torch.exp(scores - lse[..., None]), 0.0)
    dv = p.transpose(-1, -2) @ dof
    ds = p * (dof @ vf.transpose(-1, -2) - (dof * of).sum(-1, keepdim=True)) * scale
    return tuple(_new_bshd(q).copy_(t) for t in (ds @ kf, ds.transpose(-1, -2) @ qf, dv))


# --------------------------------------------------------------------------------------------------
# Autograd glue: custom ops, so the op works under torch.compile (no tracing into Triton); eager calls
# run the same bodies and formulas without the dispatcher (kernels/op.py)
# --------------------------------------------------------------------------------------------------


def _attention_impl(q: Tensor, k: Tensor, v: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Returns (o, lse); lse is saved for the backward."""
    if use_triton(q):
        return masked_attention_fwd(q, k, v, valid)
    _check_inputs(q, k, v, valid)
    return _masked_attention_fwd_ref(q, k, v, valid)


def _bshd_fake(q: Tensor) -> Tensor:
    b, h, s, d = q.shape
    return q.new_empty_strided((b, h, s, d), (s * h * d, d, h * d, 1))


def _attention_fake(q, k, v, valid):
    _check_inputs(q, k, v, valid)
    return _bshd_fake(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _attention_backward_impl(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, valid: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    if use_triton(q):
        return masked_attention_bwd(do, q, k, v, o, lse, valid)
    _check_inputs(q, k, v, valid)
    return _masked_attention_bwd_ref(do, q, k, v, o, lse, valid)


def _attention_backward_fake(do, q, k, v, o, lse, valid):
    return _bshd_fake(q), _bshd_fake(q), _bshd_fake(q)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, valid = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, valid)


def _backward(backward_fn, ctx, do: Tensor, _dlse: Tensor | None):
    # _dlse: the gradient w.r.t. the internal output lse, which masked_attention never exposes.
    q, k, v, o, lse, valid = ctx.saved_tensors
    dq, dk, dv = backward_fn(do, q, k, v, o, lse, valid)
    return dq, dk, dv, None


_masked_attention = define_op(
    "masked_attention", _attention_impl, _attention_fake, _setup_context, _backward,
    _attention_backward_impl, _attention_backward_fake,
)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def masked_attention(q: Tensor, k: Tensor, v: Tensor, valid: Tensor) -> Tensor:
    """Fused multi-head attention ``softmax(q k^T / sqrt(d)) v`` over the valid keys, forward and backward
    in one Triton kernel each (one program per sample and head).

    Differentiable in q, k and v; works in eager and under ``torch.compile`` (the custom op
    ``torch.ops.dlrm.masked_attention``, whose backward is ``torch.ops.dlrm.masked_attention_backward``).
    Runs the Triton kernels on CUDA tensors (and on CPU under ``TRITON_INTERPRET=1``), else plain PyTorch.

    Args:
        q, k, v: [B, H, S, d] tensors, fp32, bf16 or fp16, one dtype and device, unit stride along d
            (else copied); 1 <= S <= 128, 1 <= d <= 256.
        valid: [B, S] bool: key j of sample b takes part (False: masked out of every softmax of b).

    Returns:
        [B, H, S, d] in q's dtype, laid out as [B, S, H, d] in memory; 0 for a query with no valid key.

    Raises:
        ValueError: shapes that differ or are out of range, dtypes, a valid mask not [B, S] bool, devices.
    """
    o, _ = _masked_attention(q, k, v, valid)
    return o
