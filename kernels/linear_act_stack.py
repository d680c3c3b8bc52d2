"""A stack of linear_act layers (an MLP) as one autograd node: ``x_{i+1} = act_i(x_i @ W_i^T + b_i)``.

Launched from Python (no CUDA graph), a layer's forward and backward cost host time the kernels do not:
each autograd.Function pays its glue, a sizeable share of eager Linear+ReLU's whole forward + backward
(``scripts/bench_launch_host.py`` measures both).
This runs every layer's forward (``kernels.linear_act``'s body: the same kernels, the same saved tensors)
inside one Function, and every layer's backward, last to first, inside its backward, so an MLP pays the
glue once. The result and the gradients are those of the layers called one by one (the same kernels in
the same order). Under torch.compile or torch.export the layers are the ``dlrm::linear_act`` custom ops,
one per layer, as ``linear_act`` gives them.

Shapes: x [M, K_0]; weights[i] [N_i, K_i] with K_{i+1} = N_i; biases[i] [N_i] or None; returns [M, N_last].
Dtypes as ``linear_act`` (one dtype for all); the math, precision and errors are ``linear_act``'s.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.compiler import is_compiling

from kernels.linear_act import _backward_body, _forward, linear_act, saved_for_backward

__all__ = ["linear_act_stack"]


class _LinearActStack(torch.autograd.Function):
    """Inputs: x, the activations (a tuple of str), then W_0, b_0, W_1, b_1, ... (b_i may be None)."""

    @staticmethod
    def forward(ctx, x: Tensor, activations: tuple[str, ...], *params: Tensor | None) -> Tensor:
        ctx.set_materialize_grads(False)
        saved = []
        for i, activation in enumerate(activations):
            weight, bias = params[2 * i], params[2 * i + 1]
            y, z, x_padded = _forward(x, weight, bias, activation)
            saved += saved_for_backward(x, weight, activation, y, z, x_padded)  # as linear_act saves
            x = y
        ctx.save_for_backward(*saved)
        ctx.activations = activations
        ctx.has_bias = tuple(params[2 * i + 1] is not None for i in range(len(activations)))
        return x

    @staticmethod
    def backward(ctx, dy: Tensor | None):
        n_layers = len(ctx.activations)
        grads: list[Tensor | None] = [None] * (2 * n_layers)
        if dy is None:
            return None, None, *grads
        saved = ctx.saved_tensors
        for i in reversed(range(n_layers)):
            x, weight, act_input = saved[3 * i : 3 * i + 3]
            needs_dx = i > 0 or ctx.needs_input_grad[0]  # layer 0's input is often data
            dy, grads[2 * i], grads[2 * i + 1] = _backward_body(
                dy, x, weight, act_input, ctx.activations[i], ctx.has_bias[i], needs_dx
            )
        return (dy if ctx.needs_input_grad[0] else None), None, *grads


def linear_act_stack(
    x: Tensor, weights: list[Tensor], biases: list[Tensor | None], activations: list[str]
) -> Tensor:
    """``linear_act`` applied layer after layer (module docstring): one autograd node for the stack.

    Args:
        x: [M, K_0] tensor, fp32, bf16 or fp16.
        weights: per layer [N_i, K_i] (nn.Linear layout), x's dtype and device, K_{i+1} = N_i.
        biases: per layer [N_i] or None.
        activations: per layer one of ``kernels.linear_act.ACTIVATIONS``.

    Returns:
        [M, N_last] tensor of x's dtype, equal to the layer-by-layer ``linear_act`` result.

    Raises:
        ValueError: the three lists differ in length or are empty; or a layer's inputs are bad (as
            ``linear_act`` raises them, naming the values).
    """
    if not (len(weights) == len(biases) == len(activations) > 0):
        raise ValueError(
            f"linear_act_stack: need as many weights, biases and activations, at least one each, got "
            f"{len(weights)}, {len(biases)} and {len(activations)}"
        )
    if is_compiling():
        for weight, bias, activation in zip(weights, biases, activations, strict=True):
            x = linear_act(x, weight, bias, activation)
        return x
    params = [p for pair in zip(weights, biases, strict=True) for p in pair]
    return _LinearActStack.apply(x, tuple(activations), *params)
