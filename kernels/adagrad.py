"""Adagrad's dense step on one parameter in one Triton kernel: each element read and written once.

Math (torch.optim.Adagrad with lr_decay 0; Duchi et al. 2011), elementwise over a parameter p, its gradient g
(weight decay already added) and its accumulator s:
    s <- s + g * g
    p <- p - lr * ((g / (sqrt(s) + eps)) * scale)
with `lr` the group's learning rate (a Python number, a constant of the run) and `scale` a 0-d fp32 device
tensor read by the kernel (the schedule's factor: a CUDA-graph replay reads its current value). The
operations run in this order with IEEE-rounded square root and division, the order and roundings of
dlrm.optim.Adagrad's foreach ops (up to multiply-adds that either side may fuse).

Why a kernel: the foreach form takes six passes over the parameters (addcmul, sqrt, add, div, mul, add),
fifteen reads and writes of an element where this one takes five. Shapes: p, g and s one shape, contiguous,
fp32, one device. The PyTorch reference is ``adagrad_step_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.launch import use_triton

__all__ = ["adagrad_step", "adagrad_step_ref"]

BLOCK = 4096  # elements a program: a pure stream, 16 KB of each fp32 tensor


@triton.jit(do_not_specialize=["n", "lr", "eps"])
def _adagrad_kernel(
    p_ptr,  # [n] fp32 parameter, updated in place
    g_ptr,  # [n] fp32 gradient
    s_ptr,  # [n] fp32 accumulator, updated in place
    scale_ptr,  # [] fp32 learning-rate factor, read at launch (each replay of a captured graph)
    lr,
    eps,
    n,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    g = tl.load(g_ptr + i, mask=mask, other=0.0)
    s = tl.load(s_ptr + i, mask=mask, other=0.0) + g * g
    tl.store(s_ptr + i, s, mask=mask)
    step = tl.div_rn(g, tl.sqrt_rn(s) + eps) * tl.load(scale_ptr)
    p = tl.load(p_ptr + i, mask=mask, other=0.0)
    tl.store(p_ptr + i, p - lr * step, mask=mask)


def _bad_tensors(p: Tensor, g: Tensor, s: Tensor) -> list[str]:
    tensors = {"parameter": p, "gradient": g, "accumulator": s}
    return [
        f"{name} {t.dtype} {list(t.shape)} on {t.device}"
        for name, t in tensors.items()
        if t.dtype != torch.float32 or t.shape != p.shape or t.device != p.device or not t.is_contiguous()
    ]


def adagrad_step_takes(p: Tensor, g: Tensor, s: Tensor) -> bool:
    """Whether adagrad_step takes these tensors: p, g and s contiguous fp32 of one shape and device."""
    return not _bad_tensors(p, g, s)


def _check(p: Tensor, g: Tensor, s: Tensor, scale: Tensor) -> None:
    bad = _bad_tensors(p, g, s)
    if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != p.device:
        bad.append(f"scale {scale.dtype} {list(scale.shape)} on {scale.device}")
    if bad:
        raise ValueError(
            "adagrad_step: parameter, gradient and accumulator must be contiguous fp32 of one shape and "
            f"device, the scale one fp32 element there; got {', '.join(bad)}"
        )


def adagrad_step(p: Tensor, g: Tensor, s: Tensor, lr: float, scale: Tensor, eps: float) -> None:
    """One Adagrad step of `p` in place (module docstring), and of its accumulator `s`.

    Args:
        p: parameter, any shape, fp32, contiguous; updated in place.
        g: its gradient (weight decay included), p's shape, fp32, contiguous.
        s: its accumulator, p's shape, fp32, contiguous; updated in place.
        lr: the learning rate; eps: added to sqrt(s) in the denominator.
        scale: [] or [1] fp32 on p's device, the factor of lr (read on the device).
    Raises:
        ValueError: dtypes, shapes, devices or layouts not as above.
    """
    _check(p, g, s, scale)
    if not use_triton(p):
        adagrad_step_ref(p, g, s, lr, scale, eps)
        return
    n = p.numel()
    if n:
        _adagrad_kernel[(triton.cdiv(n, BLOCK),)](p, g, s, scale, lr, eps, n, BLOCK=BLOCK)


def adagrad_step_ref(p: Tensor, g: Tensor, s: Tensor, lr: float, scale: Tensor, eps: float) -> None:
    """``adagrad_step`` in PyTorch ops, in place (the CPU fallback and the tests' twin)."""
    s.addcmul_(g, g)
    p.sub_(g / (s.sqrt() + eps) * scale.reshape(()), alpha=lr)
