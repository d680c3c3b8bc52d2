"""Activations shared by the MLP kernels: Triton device functions and their PyTorch references.

    identity   y = z                                  act'(z) = 1
    relu       y = max(z, 0) (NaN for NaN)            act'(z) = 1 if z > 0 else 0   (= [y > 0])
    sigmoid    y = s(z) = 1 / (1 + exp(-z))           act'(z) = s(z) (1 - s(z))     (= y (1 - y))
    gelu_tanh  y = 0.5 z (1 + tanh(u)), u = sqrt(2/pi) (z + 0.044715 z^3)  (GELU, tanh approximation;
               = z s(2u))                             act'(z) = s(2u) + 2 z s(2u) (1 - s(2u)) du/dz
    silu       y = z s(z)                             act'(z) = s(z) (1 + z (1 - s(z)))

The Triton functions take and return fp32 tiles. The sigmoid is 1 / (1 + exp(-z)) with the GPU's approximate
reciprocal (``reciprocal``): exp(-z) may overflow to inf, whose reciprocal is 0. The references equal
torch.relu / torch.sigmoid / F.gelu(approximate="tanh") / F.silu.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from kernels.launch import INTERPRETED

ACTIVATIONS = ("identity", "relu", "sigmoid", "gelu_tanh", "silu")

_SQRT_2_OVER_PI = 0.7978845608028654  # sqrt(2 / pi)
_GELU_C = 0.044715


def check_activation(op: str, activation: str) -> None:
    """Raise ValueError naming `op` and the allowed values when `activation` is unknown."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: unknown activation {activation!r}; expected one of {ACTIVATIONS}")


_INTERPRETED = tl.constexpr(INTERPRETED)


@triton.jit
def reciprocal(v):
    """1 / v for an fp32 tile: on the GPU one ``rcp.approx.ftz.f32`` instruction (max error ~1 ulp; 1 / inf
    = 0), where ``1.0 / v`` compiles to a longer division sequence, which costs GEMM epilogues (GELU, SiLU,
    sigmoid) measurable time; against float64 the sigmoid keeps a relative error <= 4e-6 for z >= -6. The
    interpreter runs no PTX: there it divides."""
    if _INTERPRETED:
        r = 1.0 / v
    else:
        r = tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=True, pack=1
        )
    return r


@triton.jit
def sigmoid(v):
    """1 / (1 + exp(-v)) for an fp32 tile: exp(-v) = inf for v < ~-88 gives 0, and NaN stays NaN."""
    return reciprocal(1.0 + tl.exp(-v))


@triton.jit
def act_fwd(z, ACTIVATION: tl.constexpr):
    """act(z) for an fp32 tile z."""
    if ACTIVATION == "relu":
        # NaN stays NaN, as in torch.relu (the GPU's max returns the other operand): a NaN input must
        # reach the loss, where train.on_nonfinite sees it.
        y = tl.maximum(z, 0.0, propagate_nan=tl.PropagateNan.ALL)
    elif ACTIVATION == "sigmoid":
        y = sigmoid(z)
    elif ACTIVATION == "gelu_tanh":
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        y = z * sigmoid(2.0 * u)  # 0.5 z (1 + tanh(u)) == z sigmoid(2u)
    elif ACTIVATION == "silu":
        y = z * sigmoid(z)
    else:  # identity
        y = z
    return y


@triton.jit
def act_grad(z, ACTIVATION: tl.constexpr):
    """act'(z) for an fp32 tile z."""
    if ACTIVATION == "relu":
        g = tl.where(z > 0.0, 1.0, 0.0)
    elif ACTIVATION == "sigmoid":
        s = sigmoid(z)
        g = s * (1.0 - s)
    elif ACTIVATION == "gelu_tanh":
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
        s = sigmoid(2.0 * u)  # sigmoid(2u) = (1 + tanh(u)) / 2
        g = s + 2.0 * z * s * (1.0 - s) * du
    elif ACTIVATION == "silu":
        s = sigmoid(z)
        g = s * (1.0 + z * (1.0 - s))
    else:  # identity
        g = tl.full(z.shape, 1.0, tl.float32)
    return g


@triton.jit
def act_bwd(dy, s, ACTIVATION: tl.constexpr):
    """dz = dy * act'(z) for fp32 tiles, from the tensor s a forward saved: y = act(z) for relu and sigmoid
    (relu' = [y > 0], sigmoid' = y (1 - y)), z for gelu_tanh and silu; s is not read for identity."""
    if ACTIVATION == "relu":
        dz = tl.where(s > 0.0, dy, 0.0)
    elif ACTIVATION == "sigmoid":
        dz = dy * s * (1.0 - s)
    elif ACTIVATION == "identity":
        dz = dy
    else:  # gelu_tanh, silu: s is z
        dz = dy * act_grad(s, ACTIVATION)
    return dz


def act_bwd_ref(dy: Tensor, saved: Tensor | None, activation: str) -> Tensor:
    """``act_bwd`` in plain PyTorch: dz = dy * act'(z) in fp32 (dy [M, N] of any float dtype), from the
    tensor the forward saved (y for relu and sigmoid, z for gelu_tanh and silu, None for identity)."""
    dy = dy.float()
    s = saved.float() if saved is not None else None
    if activation == "identity":
        return dy
    if activation == "relu":
        return torch.where(s > 0, dy, 0.0)
    if activation == "sigmoid":
        return dy * s * (1.0 - s)
    return dy * act_grad_ref(s, activation)  # gelu_tanh, silu: s is z


def act_ref(z: Tensor, activation: str) -> Tensor:
    """act(z) in plain PyTorch (differentiable). Raises ValueError for an unknown activation."""
    check_activation("act_ref", activation)
    if activation == "relu":
        return torch.relu(z)
    if activation == "sigmoid":
        return torch.sigmoid(z)
    if activation == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if activation == "silu":
        return F.silu(z)
    return z


def act_grad_ref(z: Tensor, activation: str) -> Tensor:
    """act'(z) in plain PyTorch, analytic (inside a custom op's implementation autograd does not record).
    Raises ValueError for an unknown activation."""
    check_activation("act_grad_ref", activation)
    if activation == "relu":
        return (z > 0).to(z.dtype)
    if activation == "sigmoid":
        s = torch.sigmoid(z)
        return s * (1.0 - s)
    if activation == "gelu_tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (z + _GELU_C * z**3))
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_C * z * z)
    if activation == "silu":
        s = torch.sigmoid(z)
        return s * (1.0 + z * (1.0 - s))
    return torch.ones_like(z)
