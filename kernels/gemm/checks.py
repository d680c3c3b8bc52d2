"""Checks of a GEMM's operands that raise ValueError with one line naming the op and the values."""

from __future__ import annotations

from torch import Tensor

from kernels.launch import DTYPES

__all__ = ["check_dtypes", "check_like", "check_linear"]


def check_linear(op: str, x: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    """Check a linear layer's operands: x [M, K], weight [N, K] (N, K >= 1), bias [N] or None, one dtype of
    ``DTYPES`` and one device. Works on fake tensors too.

    Raises:
        ValueError: naming `op` and the offending values.
    """
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"{op}: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"{op}: weight [N, K] must have K = {x.shape[1]} columns for x of shape {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if x.shape[1] < 1 or weight.shape[0] < 1:
        raise ValueError(
            f"{op}: need K >= 1 and N >= 1, got x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(
            f"{op}: bias must have shape [N] = [{weight.shape[0]}] for weight of shape "
            f"{tuple(weight.shape)}, got {tuple(bias.shape)}"
        )
    check_dtypes(op, x=x, weight=weight, bias=bias)


def check_dtypes(op: str, **tensors: Tensor | None) -> None:
    """Check that the first of `tensors` has a dtype of ``DTYPES`` and every other one (None: skipped) its
    dtype and device; the keywords are the tensors' names in the messages. Works on fake tensors too.

    Raises:
        ValueError: naming `op`, the tensor and its dtype or device.
    """
    (first, x), *others = tensors.items()
    if x.dtype not in DTYPES:
        raise ValueError(f"{op}: {first} dtype must be one of {DTYPES}, got {x.dtype}")
    for name, t in others:
        if t is None:
            continue
        if t.dtype != x.dtype:
            raise ValueError(f"{op}: {name} dtype {t.dtype} differs from {first} dtype {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first} is on {x.device}")


def check_like(op: str, name: str, t: Tensor | None, shape: tuple[int, ...], x: Tensor) -> None:
    """Raise ValueError naming `op` and `name` unless t is a tensor of `shape` with x's dtype and device."""
    if t is None or tuple(t.shape) != tuple(shape) or t.dtype != x.dtype or t.device != x.device:
        got = "None" if t is None else f"({tuple(t.shape)}, {t.dtype}, {t.device})"
        raise ValueError(f"{op}: {name} must be ({tuple(shape)}, {x.dtype}, {x.device}), got {got}")
