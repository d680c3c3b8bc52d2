"""Binary cross-entropy with logits, forward and gradient in one kernel.

Math (x the logit, y the 0/1 label, B samples)
    loss_i = max(x, 0) - x y + log(1 + exp(-|x|))      (the numerically stable form, no overflow)
    loss   = (1/B) sum_i loss_i
    dloss/dx_i = (sigmoid(x_i) - y_i) / B
This is torch.nn.functional.binary_cross_entropy_with_logits (reduction "mean").

Shapes and dtypes: logits [B] fp32/bf16/fp16, labels [B] float (0/1); loss a 0-d fp32 tensor, the
gradient [B] in the logits' dtype. Compute: fp32.
The forward computes the gradient too (it costs one more [B] store and saves a backward kernel); backward
only scales it by the incoming gradient of the loss. Up to 4096 samples one program reduces the whole
batch and stores the result (one launch); past that each program stores its partial sum and one torch.sum
adds the partials (one program streaming a large batch alone is slower than several programs plus the
sum). The partials are added in a fixed order, not by atomic adds in the order the programs finish, so the
loss is the same bits on every run (a resumed run's logged losses equal the uninterrupted run's). No host
sync.
The PyTorch reference is `bce_with_logits_ref`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from kernels.activations import sigmoid
from kernels.launch import DTYPES, use_triton
from kernels.op import define_op

__all__ = ["bce_with_logits", "bce_with_logits_ref"]

_BLOCK = 1024
_SINGLE_BLOCK = 4096  # up to this batch one program does it all: no atomics, no zeroed output


@triton.jit(do_not_specialize=["B", "scale"])
def _bce_fwd_kernel(
    # pointers
    logits_ptr,  # [B]
    labels_ptr,  # [B]
    partial_ptr,  # [programs] fp32 output: each program's partial sum of the scaled loss
    dlogits_ptr,  # [B], logits' dtype
    # sizes
    B,
    scale,  # of the loss and the gradient: 1/B, for the mean
    # meta-parameters
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = i < B
    x = tl.load(logits_ptr + i, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(labels_ptr + i, mask=mask, other=0.0).to(tl.float32)
    loss = tl.maximum(x, 0.0) - x * y + tl.log(1.0 + tl.exp(-tl.abs(x)))
    tl.store(partial_ptr + tl.program_id(0), tl.sum(tl.where(mask, loss, 0.0), axis=0) * scale)
    tl.store(dlogits_ptr + i, ((sigmoid(x) - y) * scale).to(dlogits_ptr.dtype.element_ty), mask=mask)


def _check_inputs(logits: Tensor, labels: Tensor) -> None:
    if logits.ndim != 1 or labels.shape != logits.shape:
        raise ValueError(
            f"logits and labels must both be [B], got {list(logits.shape)} and {list(labels.shape)}"
        )
    if logits.dtype not in DTYPES or not labels.is_floating_point():
        raise ValueError(
            f"logits dtype {logits.dtype} (expected one of {DTYPES}), labels {labels.dtype} (float)"
        )
    if logits.device != labels.device:
        raise ValueError(f"logits on {logits.device} but labels on {labels.device}")


def bce_with_logits_fwd(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Launch the kernel: (mean loss, 0-d fp32; dloss/dlogits [B]). See `bce_with_logits`."""
    _check_inputs(logits, labels)
    logits, labels = logits.contiguous(), labels.contiguous()
    b = logits.shape[0]
    dlogits = torch.empty_like(logits)
    if b == 0:  # the mean of nothing, as torch
        return torch.full((), float("nan"), dtype=torch.float32, device=logits.device), dlogits
    # One program per _BLOCK samples, or a single program for the whole batch up to _SINGLE_BLOCK samples,
    # whose partial sum is the loss (no second launch).
    block = min(max(16, triton.next_power_of_2(b)), _SINGLE_BLOCK) if b <= _SINGLE_BLOCK else _BLOCK
    grid = triton.cdiv(b, block)
    partials = torch.empty(grid, dtype=torch.float32, device=logits.device)
    _bce_fwd_kernel[(grid,)](
        logits, labels, partials, dlogits, b, 1.0 / b, BLOCK=block, num_warps=16 if block > 4096 else 4,
    )  # fmt: skip
    return (partials[0] if grid == 1 else partials.sum()), dlogits


def bce_with_logits_ref(logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
    """PyTorch reference: F.binary_cross_entropy_with_logits in fp32."""
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction=reduction)


# --------------------------------------------------------------------------------------------------
# Autograd glue: custom ops for torch.compile; eager calls skip the dispatcher (kernels/op.py)
# --------------------------------------------------------------------------------------------------


def _bce_impl(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    if use_triton(logits):
        return bce_with_logits_fwd(logits, labels)
    _check_inputs(logits, labels)
    x = logits.float()
    grad = (torch.sigmoid(x) - labels) / logits.shape[0]
    return bce_with_logits_ref(x, labels), grad.to(logits.dtype)


def _bce_fake(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    return logits.new_empty((), dtype=torch.float32), torch.empty_like(logits)


def _setup_context(ctx, inputs, output) -> None:
    _, dlogits = output
    ctx.save_for_backward(dlogits)
    ctx.mark_non_differentiable(dlogits)


def _backward(ctx, grad_loss: Tensor, _grad_dlogits):
    (dlogits,) = ctx.saved_tensors
    return dlogits * grad_loss.to(dlogits.dtype), None


_bce_with_logits = define_op("bce_with_logits", _bce_impl, _bce_fake, _setup_context, _backward)


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def bce_with_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean binary cross-entropy with logits; differentiable in `logits` (the custom op
    `torch.ops.dlrm.bce_with_logits`). One Triton kernel on CUDA (and on CPU under TRITON_INTERPRET=1).

    Args:
        logits: [B] fp32/bf16/fp16.
        labels: [B] float, 0 or 1, same device.
    Returns:
        0-d fp32 tensor, mean over the batch (NaN for B = 0, as PyTorch).
    Raises:
        ValueError: shapes, dtypes or devices that do not match (the message names them).
    """
    loss, _ = _bce_with_logits(logits, labels)
    return loss
