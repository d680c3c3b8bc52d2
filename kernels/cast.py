"""Many tensors cast to one dtype in one launch (``cast_together``): an MLP stack's fp32 weights and biases to
the autocast dtype before its layers, and their gradients back to fp32 after (dlrm.model.mlp).

Why a kernel: ``torch._foreach_copy_`` casts a list in one multi_tensor_apply launch too, but it cuts the
elements into chunks of 65,536, one thread block each, so the kaggle config's stacks (about 0.5M values in 8
and 6 tensors) get about ten blocks on a 132-SM GPU, each streaming its chunk alone: ~8.5 us a launch, four
launches a step, 32 us of the 157 us graphed bf16 step at batch 128
(scripts/results/profile_kaggle_triton_graphs_128_bf16.txt). Here program (i, k) casts elements
[i BLOCK, (i + 1) BLOCK) of tensor k: cdiv(numel, BLOCK) programs a tensor, hundreds in all.

The tensors are the kernel's arguments, MAX_TENSORS pointers each way (unused ones repeat the first and
count 0 elements): arguments are part of a captured CUDA graph, where a device table of pointers would
have to be written on the device before every replay.

Shapes and dtypes: up to MAX_TENSORS contiguous tensors of one float dtype (DTYPES) and device, any shapes,
each under 2**31 elements (32-bit offsets); the results have their shapes in `dtype`, rounded to nearest
even as ``Tensor.to`` rounds (a bf16 result's bits computed in integer arithmetic, `_bf16_bits`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.launch import DTYPES

__all__ = ["MAX_TENSORS", "cast_together"]

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
def _cast_block(src_ptr, dst_ptr, n, offsets):
    """Elements `offsets` of one tensor (n elements), cast to the destination's dtype; an int16 destination
    is a bf16 tensor's bits."""
    mask = offsets < n
    x = tl.load(src_ptr + offsets, mask=mask).to(tl.float32)
    if dst_ptr.dtype.element_ty == tl.int16:
        tl.store(dst_ptr + offsets, _bf16_bits(x), mask=mask)
    else:
        tl.store(dst_ptr + offsets, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cast_kernel(
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15,
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15,
    n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (i, k): block i of tensor k (the module docstring). Through fp32: every float dtype's values
    are exact in fp32, so each element is rounded once, to the destination's dtype."""
    k = tl.program_id(1)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if k == 0:
        _cast_block(s0, d0, n0, offsets)
    elif k == 1:
        _cast_block(s1, d1, n1, offsets)
    elif k == 2:
        _cast_block(s2, d2, n2, offsets)
    elif k == 3:
        _cast_block(s3, d3, n3, offsets)
    elif k == 4:
        _cast_block(s4, d4, n4, offsets)
    elif k == 5:
        _cast_block(s5, d5, n5, offsets)
    elif k == 6:
        _cast_block(s6, d6, n6, offsets)
    elif k == 7:
        _cast_block(s7, d7, n7, offsets)
    elif k == 8:
        _cast_block(s8, d8, n8, offsets)
    elif k == 9:
        _cast_block(s9, d9, n9, offsets)
    elif k == 10:
        _cast_block(s10, d10, n10, offsets)
    elif k == 11:
        _cast_block(s11, d11, n11, offsets)
    elif k == 12:
        _cast_block(s12, d12, n12, offsets)
    elif k == 13:
        _cast_block(s13, d13, n13, offsets)
    elif k == 14:
        _cast_block(s14, d14, n14, offsets)
    else:
        _cast_block(s15, d15, n15, offsets)


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
    if not 1 <= len(tensors) <= MAX_TENSORS:
        raise ValueError(f"cast_together: 1 to {MAX_TENSORS} tensors, got {len(tensors)}")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"cast_together: tensor {i} is {t.dtype} on {t.device}, tensor 0 {first.dtype} on "
                f"{first.device}"
            )
        if not t.is_contiguous() or t.numel() >= 2**31:
            raise ValueError(f"cast_together: tensor {i} must be contiguous with < 2**31 elements")
    if first.dtype not in DTYPES or dtype not in DTYPES:
        raise ValueError(f"cast_together: dtypes must be among {DTYPES}, got {first.dtype} -> {dtype}")
    out = [torch.empty_like(t, dtype=dtype) for t in tensors]
    largest = max(t.numel() for t in tensors)
    if largest == 0:
        return out
    # Empty tensors and the unused slots pass a non-empty pair with 0 elements: an empty tensor's pointer
    # may be null, which a launch refuses.
    fill = next(i for i, t in enumerate(tensors) if t.numel())
    pairs = [(t, o) if t.numel() else (tensors[fill], out[fill]) for t, o in zip(tensors, out, strict=True)]
    pairs += [(tensors[fill], out[fill])] * (MAX_TENSORS - len(tensors))
    counts = [t.numel() for t in tensors] + [0] * (MAX_TENSORS - len(tensors))
    sources, targets = (list(side) for side in zip(*pairs, strict=True))
    if dtype == torch.bfloat16:  # written as bits (`_bf16_bits`)
        targets = [t.view(torch.int16) for t in targets]
    grid = (triton.cdiv(largest, BLOCK), len(tensors))
    _cast_kernel[grid](*sources, *targets, *counts, BLOCK=BLOCK, num_warps=8)
    return out
