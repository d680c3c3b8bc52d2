"""The whole DCNv2 low-rank cross network as one op: L fused cross layers (``kernels.cross``) forward, and a
backward in which x0's gradient sums over the layers inside the layers' own kernels.

Math (letters as ``kernels.cross``; l = 0 .. L-1, x_0 = x0, the output x_L)
    x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l
    dL/dx0  = sum over l of g_l * (z_l + b_l)  +  dL/dx_0 through the first layer's x_l term
            = sum over l of g_l * (z_l + b_l)  +  g_0 + dh_0 @ V_0,        g_l = dL/dx_{l+1}

Why one op: x0 feeds every layer, so layer by layer (one ``cross_layer`` each) autograd receives L + 1
gradients of x0 [M, N] and adds them with separate kernels, each reading two [M, N] tensors and writing one
(at the MLPerf model's M = 65,536, N = 3,456, bf16: 0.45 GB a tensor). Here the backward walks the layers
from the last, and each layer's kernel adds its term to the sum of the later layers' in its epilogue
(``kernels.cross.launch_bwd_inputs``' acc), so the sum is written once a layer and read once by the next,
and the first layer's x_l gradient g_0 + dh_0 @ V_0 lands on it (that function's dxl=None): one x0
gradient, no add kernels.

Shapes: x0 [M, N]; v [L, r, N]; u [L, N, r]; b [L, N] (the layers' V_l, U_l, b_l stacked); one dtype (fp32,
bf16 or fp16) and device; M >= 0, N, r, L >= 1. The forward keeps x_1 .. x_{L-1} [L-1, M, N] and every
layer's h_l [L, M, r] and z_l + b_l [L, M, N] for the backward, as the layers one by one would.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import launch
from kernels.cross import (
    check_inputs,
    cross_layer_bwd_ref,
    cross_layer_fwd_ref,
    cross_layer_ref,
    launch_bwd_inputs,
    launch_fwd,
)
from kernels.gemm.layout import rows_contiguous
from kernels.launch import use_triton
from kernels.op import define_op

__all__ = ["cross_net", "cross_net_ref"]


def check_net_inputs(x0: Tensor, v: Tensor, u: Tensor, b: Tensor) -> None:
    """Raise ValueError naming the offending values: stacks of L layers, each as ``cross_layer`` takes it."""
    if v.dim() != 3 or u.dim() != 3 or b.dim() != 2 or not v.shape[0] == u.shape[0] == b.shape[0] >= 1:
        raise ValueError(
            f"cross_net: v [L, r, N], u [L, N, r] and b [L, N] with L >= 1, got v {tuple(v.shape)}, "
            f"u {tuple(u.shape)}, b {tuple(b.shape)}"
        )
    check_inputs(x0, x0, v[0], u[0], b[0])


def _forward(x0: Tensor, v: Tensor, u: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The forward's body: (x_L [M, N], x_1 .. x_{L-1} [L-1, M, N], h [L, M, r], zb [L, M, N])."""
    check_net_inputs(x0, v, u, b)
    layers, (m, n), r = v.shape[0], x0.shape, v.shape[1]
    out = launch.empty((m, n), x0.dtype, x0.device)
    inner = launch.empty((layers - 1, m, n), x0.dtype, x0.device)
    h = launch.empty((layers, m, r), x0.dtype, x0.device)
    zb = launch.empty((layers, m, n), x0.dtype, x0.device)
    x = x0
    for layer in range(layers):
        target = out if layer == layers - 1 else inner[layer]
        if use_triton(x0):
            launch_fwd(x0, x, v[layer], u[layer], b[layer], out=target, h=h[layer], zb=zb[layer])
        else:
            target[:], h[layer], zb[layer] = cross_layer_fwd_ref(x0, x, v[layer], u[layer], b[layer])
        x = target
    return out, inner, h, zb


def _forward_fake(x0: Tensor, v: Tensor, u: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_net_inputs(x0, v, u, b)
    m, n = x0.shape
    return (
        x0.new_empty((m, n)),
        x0.new_empty((v.shape[0] - 1, m, n)),
        x0.new_empty((v.shape[0], m, v.shape[1])),
        x0.new_empty((v.shape[0], m, n)),
    )


def _backward(
    g: Tensor, x0: Tensor, v: Tensor, u: Tensor, b: Tensor, inner: Tensor, h: Tensor, zb: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward's body (module docstring): (dx0 [M, N], dv [L, r, N], du [L, N, r], db [L, N])."""
    layers = v.shape[0]
    dv, du, db = torch.empty_like(v), torch.empty_like(u), torch.empty_like(b)
    if not use_triton(x0):
        dx0 = torch.zeros_like(x0)
        for layer in reversed(range(layers)):
            xl = x0 if layer == 0 else inner[layer - 1]
            direct, g, dv[layer], du[layer], db[layer] = cross_layer_bwd_ref(
                g, x0, xl, v[layer], u[layer], b[layer], h[layer], zb[layer]
            )
            dx0 += direct
        return dx0 + g, dv, du, db
    x0 = rows_contiguous(x0)
    # Two buffers for x0's running sum, in turns: a layer reads one and writes the other.
    sums = [launch.empty(x0.shape, x0.dtype, x0.device) for _ in range(min(layers, 2))]
    acc = None
    for layer in reversed(range(layers)):
        xl = x0 if layer == 0 else inner[layer - 1]
        dx0 = sums[layer % len(sums)]
        g = rows_contiguous(g)
        # x_l's gradient: autograd's g (the last layer's) is never written, so it goes to a new tensor; a
        # gradient this loop made takes it in place; the first layer's lands on x0's (x_l is x0).
        if layer == 0:
            dxl = None
        else:
            dxl = launch.empty(x0.shape, x0.dtype, x0.device) if layer == layers - 1 else g
        dz, dh, db[layer] = launch_bwd_inputs(g, x0, zb[layer], v[layer], u[layer], acc, dxl, dx0)
        torch.matmul(dh.t(), xl, out=dv[layer])
        torch.matmul(dz.t(), h[layer], out=du[layer])
        g, acc = dxl, dx0
    return acc, dv, du, db


def _backward_fake(
    g: Tensor, x0: Tensor, v: Tensor, u: Tensor, b: Tensor, inner: Tensor, h: Tensor, zb: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(t.new_empty(t.shape) for t in (x0, v, u, b))


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs, *output[1:])


def _gradients(backward_fn, ctx, g: Tensor | None, *_saved: Tensor | None):
    # _saved: the gradients of inner, h and zb, intermediates that cross_net never exposes (None).
    return backward_fn(g, *ctx.saved_tensors)


_cross_net = define_op(
    "cross_net", _forward, _forward_fake, _setup_context, _gradients, _backward, _backward_fake
)


def cross_net(x0: Tensor, v: Tensor, u: Tensor, b: Tensor) -> Tensor:
    """The low-rank cross network x_L (module docstring) as one op, with a fused backward.

    Equals L calls of ``kernels.cross.cross_layer`` (x = cross_layer(x0, x, v[l], u[l], b[l])), to the
    rounding of x0's summed gradient (here summed in fp32 inside the kernels, rounded once a layer).
    Differentiable in every input; eager and under ``torch.compile`` (``torch.ops.dlrm.cross_net``). Triton
    kernels on CUDA tensors (and on CPU under ``TRITON_INTERPRET=1``), else plain PyTorch.

    Args:
        x0: [M, N] fp32, bf16 or fp16, contiguous columns.
        v: [L, r, N] the layers' down projections; u: [L, N, r] their up projections; b: [L, N] their
            biases; x0's dtype and device.

    Returns:
        [M, N] x_L, x0's dtype.

    Raises:
        ValueError: stacks of the wrong rank or shape, an unsupported dtype, mixed dtypes or devices.
    """
    out, _, _, _ = _cross_net(x0, v, u, b)
    return out


def cross_net_ref(x0: Tensor, v: Tensor, u: Tensor, b: Tensor) -> Tensor:
    """The network in plain PyTorch (``cross_layer_ref`` a layer), differentiable by autograd."""
    x = x0
    for layer in range(v.shape[0]):
        x = cross_layer_ref(x0, x, v[layer], u[layer], b[layer])
    return x
