"""One launch over a list of tensors, where torch's multi-tensor kernels give a small model's parameters a
handful of thread blocks: ``cast_together`` (an MLP stack's fp32 weights and biases to the autocast dtype
before its layers, and their gradients back to fp32 after; dlrm.model.mlp) and ``sgd_step_together`` (SGD's
dense step, p <- p - (lr * scale) * g, as dlrm.optim.SGD's torch._fused_sgd_ computes it).

Why a kernel: torch._foreach_copy_ and torch._fused_sgd_ take a list in one multi_tensor_apply launch too,
but cut its elements into chunks of 65,536, one thread block each, so the kaggle config's MLPs (about 0.5M
values in 8 and 6 tensors) get about ten blocks on a 132-SM GPU, each streaming its chunk alone: ~8.5 us a
cast and ~10.6 us the SGD step, five launches and 43 us of the 157 us graphed bf16 step at batch 128
(scripts/results/profile_kaggle_triton_graphs_128_bf16.txt). Here program (i, k) takes elements
[i BLOCK, (i + 1) BLOCK) of tensor k: cdiv(numel, BLOCK) programs a tensor, hundreds in all.

The tensors are the kernel's arguments, MAX_TENSORS pointers each way (unused ones repeat a used tensor and
count 0 elements): arguments are part of a captured CUDA graph, where a device table of pointers would have
to be written on the device before every replay.

Shapes and dtypes: up to MAX_TENSORS contiguous tensors (pairs for the SGD step) of one dtype and device,
any shapes, each under 2**31 elements (32-bit offsets). A cast rounds to nearest even as ``Tensor.to``
does (a bf16 result's bits computed in integer arithmetic, `_bf16_bits`); the SGD step is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.launch import DTYPES, use_triton

__all__ = ["MAX_TENSORS", "cast_together", "sgd_step_takes", "sgd_step_together"]

MAX_TENSORS = 16
# Elements a program: 4 per thread of its 8 warps.
BLOCK = 1024


@triton.jit
def _bf16_bits(x):
    """The bit patterns (int16) of x fp32 rounded to the nearest bf16, ties to even, NaN as a quiet NaN:
    ``Tensor.to``'s rounding (c10's round_to_nearest_even), in integer arithmetic, which the GPU and
    Triton's interpreter compute alike (the interpreter truncates a float conversion to bf16)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def _apply(a_ptr, b_ptr, n, offsets, scale_ptr, lr, OP: tl.constexpr):
    """Elements `offsets` of one tensor (n elements). OP "cast": b = a in b's dtype (an int16 b is a bf16
    tensor's bits); "sgd": a <- a - (scale * lr) * b, a the parameter, b its gradient."""
    mask = offsets < n
    if OP == "cast":
        x = tl.load(a_ptr + offsets, mask=mask).to(tl.float32)
        if b_ptr.dtype.element_ty == tl.int16:
            tl.store(b_ptr + offsets, _bf16_bits(x), mask=mask)
        else:
            tl.store(b_ptr + offsets, x.to(b_ptr.dtype.element_ty), mask=mask)
    else:
        rate = tl.load(scale_ptr) * lr
        p = tl.load(a_ptr + offsets, mask=mask)
        g = tl.load(b_ptr + offsets, mask=mask)
        tl.store(a_ptr + offsets, p - rate * g, mask=mask)


@triton.jit(do_not_specialize=["lr"])
def _multi_tensor_kernel(
    a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15,
    b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15,
    n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15,
    scale_ptr, lr, OP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (i, k): block i of tensor pair k (the module docstring)."""
    k = tl.program_id(1)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if k == 0:
        _apply(a0, b0, n0, offsets, scale_ptr, lr, OP)
    elif k == 1:
        _apply(a1, b1, n1, offsets, scale_ptr, lr, OP)
    elif k == 2:
        _apply(a2, b2, n2, offsets, scale_ptr, lr, OP)
    elif k == 3:
        _apply(a3, b3, n3, offsets, scale_ptr, lr, OP)
    elif k == 4:
        _apply(a4, b4, n4, offsets, scale_ptr, lr, OP)
    elif k == 5:
        _apply(a5, b5, n5, offsets, scale_ptr, lr, OP)
    elif k == 6:
        _apply(a6, b6, n6, offsets, scale_ptr, lr, OP)
    elif k == 7:
        _apply(a7, b7, n7, offsets, scale_ptr, lr, OP)
    elif k == 8:
        _apply(a8, b8, n8, offsets, scale_ptr, lr, OP)
    elif k == 9:
        _apply(a9, b9, n9, offsets, scale_ptr, lr, OP)
    elif k == 10:
        _apply(a10, b10, n10, offsets, scale_ptr, lr, OP)
    elif k == 11:
        _apply(a11, b11, n11, offsets, scale_ptr, lr, OP)
    elif k == 12:
        _apply(a12, b12, n12, offsets, scale_ptr, lr, OP)
    elif k == 13:
        _apply(a13, b13, n13, offsets, scale_ptr, lr, OP)
    elif k == 14:
        _apply(a14, b14, n14, offsets, scale_ptr, lr, OP)
    else:
        _apply(a15, b15, n15, offsets, scale_ptr, lr, OP)


def _list_problem(tensors: list[Tensor]) -> str | None:
    """What keeps `tensors` from one launch (a count outside 1..MAX_TENSORS, mixed dtypes or devices, a
    tensor not contiguous or of 2**31 elements or more), or None."""
    if not 1 <= len(tensors) <= MAX_TENSORS:
        return f"1 to {MAX_TENSORS} tensors, got {len(tensors)}"
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.dtype != first.dtype or t.device != first.device:
            return f"tensor {i} is {t.dtype} on {t.device}, tensor 0 {first.dtype} on {first.device}"
        if not t.is_contiguous() or t.numel() >= 2**31:
            return f"tensor {i} must be contiguous with < 2**31 elements"
    return None


def _launch(a: list[Tensor], b: list[Tensor], scale: Tensor | None, lr: float, op: str) -> None:
    """One launch of `op` over the pairs (a[k], b[k]); empty tensors and the unused slots pass a non-empty
    pair with 0 elements (an empty tensor's pointer may be null, which a launch refuses)."""
    counts = [t.numel() for t in a]
    if max(counts) == 0:
        return
    fill = next(k for k, n in enumerate(counts) if n)
    pairs = [(x, y) if n else (a[fill], b[fill]) for x, y, n in zip(a, b, counts, strict=True)]
    pairs += [(a[fill], b[fill])] * (MAX_TENSORS - len(a))
    counts += [0] * (MAX_TENSORS - len(a))
    firsts, seconds = (list(side) for side in zip(*pairs, strict=True))
    grid = (triton.cdiv(max(counts), BLOCK), len(a))
    scale = a[fill] if scale is None else scale
    _multi_tensor_kernel[grid](*firsts, *seconds, *counts, scale, lr, OP=op, BLOCK=BLOCK, num_warps=8)


def cast_together(tensors: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """`tensors` cast to `dtype` in one launch: new contiguous tensors, equal to ``t.to(dtype)`` each.

    Args:
        tensors: 1 to MAX_TENSORS contiguous tensors of one dtype of DTYPES and one device (CUDA, or the
            CPU under TRITON_INTERPRET=1), each under 2**31 elements.
        dtype: the results' dtype, one of DTYPES.

    Returns:
        One tensor a tensor, its shape, in `dtype`.

    Raises:
        ValueError: no tensors or more than MAX_TENSORS, mixed dtypes or devices, a dtype outside DTYPES,
            a tensor that is not contiguous or has 2**31 elements or more.
    """
    if problem := _list_problem(tensors):
        raise ValueError(f"cast_together: {problem}")
    if tensors[0].dtype not in DTYPES or dtype not in DTYPES:
        raise ValueError(f"cast_together: dtypes must be among {DTYPES}, got {tensors[0].dtype} -> {dtype}")
    out = [torch.empty_like(t, dtype=dtype) for t in tensors]
    # A bf16 result is written as its bits (`_bf16_bits`).
    targets = [t.view(torch.int16) for t in out] if dtype == torch.bfloat16 else out
    _launch(tensors, targets, None, 0.0, "cast")
    return out


def sgd_step_takes(params: list[Tensor], grads: list[Tensor]) -> bool:
    """Whether `sgd_step_together` takes these: 1 to MAX_TENSORS fp32 contiguous parameters on one device
    where our Triton kernels run (CUDA, or the CPU under TRITON_INTERPRET=1), each gradient of its
    parameter's shape, dtype and device and contiguous."""
    return (
        _list_problem(params) is None
        and params[0].dtype == torch.float32
        and use_triton(params[0])
        and len(grads) == len(params)
        and all(
            g.dtype == p.dtype and g.shape == p.shape and g.device == p.device and g.is_contiguous()
            for p, g in zip(params, grads, strict=True)
        )
    )


def sgd_step_together(params: list[Tensor], grads: list[Tensor], lr: float, scale: Tensor) -> None:
    """SGD's step on every parameter in one launch, in place: p <- p - (scale * lr) * g, the rate rounded to
    fp32 as the product of the 0-d fp32 tensor `scale` and `lr` (dlrm.optim.SGD's torch._fused_sgd_ rate).

    Args:
        params: 1 to MAX_TENSORS fp32 contiguous tensors on one device (CUDA, or the CPU under
            TRITON_INTERPRET=1), each under 2**31 elements; updated in place.
        grads: their gradients, each of its parameter's shape, dtype and device, contiguous.
        lr: the learning rate, a Python number.
        scale: 0-d fp32 tensor on the parameters' device, read by the kernel (a graph replay reads its
            current value).

    Raises:
        ValueError: tensors that `sgd_step_takes` refuses, or a `scale` that is not 0-d fp32 on their device.
    """
    if not sgd_step_takes(params, grads):
        raise ValueError(
            f"sgd_step_together: 1 to {MAX_TENSORS} fp32 contiguous parameters on one device where Triton "
            "runs, each gradient of its parameter's shape, dtype and device"
        )
    if scale.shape != () or scale.dtype != torch.float32 or scale.device != params[0].device:
        raise ValueError(
            f"sgd_step_together: scale must be a 0-d fp32 tensor on {params[0].device}, got {scale.dtype} "
            f"{list(scale.shape)} on {scale.device}"
        )
    _launch(params, grads, scale, lr, "sgd")
