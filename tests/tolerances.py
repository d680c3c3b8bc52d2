"""Per-dtype tolerances for comparing kernels with their fp32 PyTorch references.

Use as ``torch.testing.assert_close(actual, expected, **tol(dtype, "fwd"))``. The baseline is
``torch.testing.assert_close``'s own default for the dtype; every loosening from it is commented.

Kinds:
    fwd   outputs of a forward kernel (compared in the output dtype)
    grad  elementwise gradients (dx), compared in fp32 against the fp32 reference's autograd gradient
    sum   gradients reduced over rows (the bias gradient db), compared in fp32 likewise
"""

from __future__ import annotations

import torch

# assert_close defaults: fp32 (1.3e-6, 1e-5), bf16 (1.6e-2, 1e-5), fp16 (1e-3, 1e-5).
TOLERANCES: dict[torch.dtype, dict[str, dict[str, float]]] = {
    torch.float32: {
        # Loosened rtol 1.3e-6 -> 1e-5: sigmoid/gelu use exp-based forms (gelu_tanh as z*sigmoid(2u), not
        # tanh), and on the GPU tl.exp is the approximate ex2 instruction: a few ulp, more for large |z|.
        "fwd": {"rtol": 1e-5, "atol": 1e-5},
        # Loosened rtol 1.3e-6 -> 1e-5, as "fwd": act'(z) is a longer exp-based formula (gelu_tanh: ~5 ulp
        # seen in the interpreter).
        "grad": {"rtol": 1e-5, "atol": 1e-5},
        # Loosened atol 1e-5 -> 1e-4, rtol -> 1e-5: a sum over M rows in a different order (per-block tree,
        # then over blocks) than torch.sum; the error grows ~ eps * sqrt(M) * |dz| and cancellation makes
        # some sums small (seen 1.8e-5 absolute at M=300).
        "sum": {"rtol": 1e-5, "atol": 1e-4},
    },
    torch.bfloat16: {
        # Default: both sides compute in fp32 and round once to bf16, so they differ by at most 1 ulp (2**-8).
        "fwd": {"rtol": 1.6e-2, "atol": 1e-5},
        # Default: the kernel's dx is the fp32 value rounded once to bf16.
        "grad": {"rtol": 1.6e-2, "atol": 1e-5},
        # Loosened atol 1e-5 -> 1e-4: fp32 summation order, as for fp32 (then one bf16 rounding: rtol).
        "sum": {"rtol": 1.6e-2, "atol": 1e-4},
    },
    torch.float16: {
        # Default: one rounding to fp16 on each side, <= 1 ulp (2**-11 relative).
        "fwd": {"rtol": 1e-3, "atol": 1e-5},
        # Default: the kernel's dx is the fp32 value rounded once to fp16.
        "grad": {"rtol": 1e-3, "atol": 1e-5},
        # Loosened atol 1e-5 -> 1e-4: fp32 summation order, as for fp32 (then one fp16 rounding: rtol).
        "sum": {"rtol": 1e-3, "atol": 1e-4},
    },
}


def tol(dtype: torch.dtype, kind: str = "fwd") -> dict[str, float]:
    """``{"rtol": ..., "atol": ...}`` for ``dtype`` and ``kind`` ("fwd", "grad" or "sum")."""
    try:
        return dict(TOLERANCES[dtype][kind])
    except KeyError:
        raise ValueError(f"no tolerance for dtype={dtype}, kind={kind!r}") from None
