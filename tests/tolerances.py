"""Per-dtype tolerances for comparing kernels with their fp32 PyTorch references.

Use as ``torch.testing.assert_close(actual, expected, **tol(dtype, "fwd"))``. The baseline is
``torch.testing.assert_close``'s own default for the dtype; every loosening from it is commented.

Kinds:
    fwd   outputs of a forward kernel (compared in the output dtype)
    grad  elementwise gradients (dx), compared in fp32 against the fp32 reference's autograd gradient
    sum   gradients reduced over rows (the bias gradient db), compared in fp32 likewise
    gemm  outputs and gradients of a GEMM kernel (linear_act: y, dx, dW, db) whose GEMM is fp32-accurate
          (the CPU interpreter's plain fp32; on a GPU without TF32, 3xTF32 dots), elementwise in fp32 against
          the fp32 reference
    gemm_norm  the same through tensor cores (TF32 for fp32 inputs, bf16, fp16), checked as a relative
          norm, ``||actual - expected|| <= rtol * ||expected|| + atol * sqrt(numel)``: elementwise bounds
          do not fit rounded GEMM operands (outputs near zero by cancellation have large relative error)
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
        # Loosened rtol -> 1e-5, atol -> 1e-4: a reduction over K (y, dW) or N (dx) or M (dW, db) of a few
        # hundred randn products in another order than torch's; the error grows ~ eps * sqrt(terms) *
        # |partial sums| (seen 3.4e-5 absolute in dW, |dW| up to ~48, a sum over M = 130 rows).
        # The same bound holds for 3xTF32 dots (a GPU's fp32 GEMMs without allow_tf32,
        # kernels.gemm.tuning.input_precision): each operand a = hi + lo with hi = tf32(a)
        # (|lo| <= 2**-11 |a|) and lo rounded to TF32 too (error <= 2**-22 |a|); dropping lo*lo' leaves
        # <= 3 * 2**-22 ~ 7e-7 of |a b| per product, at most a few times the fp32 accumulation's own error.
        # Emulated on the CPU (round-to-nearest splits, tests/test_cross.py's layer at M, N, r up to 512,
        # 479, 64): at most 0.65 of this bound, plain fp32 GEMMs 0.82.
        "gemm": {"rtol": 1e-5, "atol": 1e-4},
        # Loosened (relative norm, see "gemm_norm" above) to 2e-3: with allow_tf32, GEMMs run in TF32, whose
        # operands keep 10 mantissa bits (rounding error up to 2**-11 each): ~4e-4 relative per product,
        # which a sum of random-sign terms keeps as ~4e-4 of the norm. 5x margin. (3xTF32 lands far under.)
        "gemm_norm": {"rtol": 2e-3, "atol": 1e-5},
    },
    torch.bfloat16: {
        # Default: both sides compute in fp32 and round once to bf16, so they differ by at most 1 ulp (2**-8).
        "fwd": {"rtol": 1.6e-2, "atol": 1e-5},
        # Default: the kernel's dx is the fp32 value rounded once to bf16.
        "grad": {"rtol": 1.6e-2, "atol": 1e-5},
        # Loosened atol 1e-5 -> 1e-4: fp32 summation order, as for fp32 (then one bf16 rounding: rtol).
        "sum": {"rtol": 1.6e-2, "atol": 1e-4},
        # Relative norm 1.6e-2 (bf16's assert_close rtol): the output is rounded once to bf16 (seen 3.4e-3 of
        # the norm), and in backward dz is rounded to bf16 before the GEMM as well (two roundings).
        "gemm_norm": {"rtol": 1.6e-2, "atol": 1e-5},
    },
    torch.float16: {
        # Default: one rounding to fp16 on each side, <= 1 ulp (2**-11 relative).
        "fwd": {"rtol": 1e-3, "atol": 1e-5},
        # Default: the kernel's dx is the fp32 value rounded once to fp16.
        "grad": {"rtol": 1e-3, "atol": 1e-5},
        # Loosened atol 1e-5 -> 1e-4: fp32 summation order, as for fp32 (then one fp16 rounding: rtol).
        "sum": {"rtol": 1e-3, "atol": 1e-4},
        # Relative norm 2e-3: one fp16 rounding of the output (seen 2.1e-4 of the norm), two in backward (dz
        # before the GEMM, then the result); fp16 has more mantissa than TF32, so the fp32 bound fits.
        "gemm_norm": {"rtol": 2e-3, "atol": 1e-5},
    },
}


def tol(dtype: torch.dtype, kind: str = "fwd") -> dict[str, float]:
    """``{"rtol": ..., "atol": ...}`` for ``dtype`` and ``kind`` (see the module docstring)."""
    try:
        return dict(TOLERANCES[dtype][kind])
    except KeyError:
        raise ValueError(f"no tolerance for dtype={dtype}, kind={kind!r}") from None
