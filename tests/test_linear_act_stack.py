"""linear_act_stack: an MLP's linear_act layers as one autograd node give what the layers give one by one.

With each layer's dz made by the two-pass path (cuBLAS's dx, then the dz pass), both run the same kernels in
the same order (in the interpreter on the CPU, compiled on a GPU), so the outputs and gradients are compared
for equality, not within a tolerance. The stack's own backward makes layer i - 1's dz in layer i's dx GEMM
(kernels/gemm/dx_act.py), which sums in another order: within the fp32 GEMM tolerance.
"""

import pytest
import torch

import kernels.linear_act as linear_act_mod
from kernels.gemm.dx_act import dx_act
from kernels.linear_act import linear_act, linear_act_stack

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# K_0 = 13 (rows padded for the GEMMs), a layer without bias, every way linear_act saves for act'.
WIDTHS = (13, 40, 24, 17, 1)
ACTIVATIONS = ["relu", "gelu_tanh", "sigmoid", "identity"]
BIASED = [True, True, False, True]


def _layers(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weights, biases = [], []
    for k, n, biased in zip(WIDTHS[:-1], WIDTHS[1:], BIASED, strict=True):
        weights.append((torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype).requires_grad_())
        biases.append(torch.randn(n, generator=g).to(DEVICE, dtype).requires_grad_() if biased else None)
    x = torch.randn(37, WIDTHS[0], generator=g).to(DEVICE, dtype)
    dy = torch.randn(37, WIDTHS[-1], generator=g).to(DEVICE, dtype)
    return x, weights, biases, dy


def _one_by_one(x, weights, biases, activations):
    for weight, bias, activation in zip(weights, biases, activations, strict=True):
        x = linear_act(x, weight, bias, activation)
    return x


def _run(fn, x, weights, biases, dy):
    params = [p for p in (*weights, *biases) if p is not None]
    inputs = ([x] if x.requires_grad else []) + params
    y = fn(x, weights, biases, ACTIVATIONS)
    return y, torch.autograd.grad(y, inputs, dy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("x_needs_grad", [True, False], ids=["x-grad", "x-data"])
def test_stack_equals_layers_one_by_one(monkeypatch, dtype, x_needs_grad):
    monkeypatch.setattr(linear_act_mod, "fastest_dx", lambda *args: "two-pass")
    monkeypatch.setattr(linear_act_mod, "_fastest_first", lambda *args: "two-pass")
    x, weights, biases, dy = _layers(dtype)
    x.requires_grad_(x_needs_grad)
    y_stack, grads_stack = _run(linear_act_stack, x, weights, biases, dy)
    y_layers, grads_layers = _run(_one_by_one, x, weights, biases, dy)
    assert y_stack.shape == (37, WIDTHS[-1])
    assert torch.equal(y_stack, y_layers)
    assert len(grads_stack) == len(grads_layers)
    for g_stack, g_layers in zip(grads_stack, grads_layers, strict=True):
        assert torch.equal(g_stack, g_layers)


@pytest.mark.parametrize(
    ("x_needs_grad", "first_layer"), [(True, None), (False, "fused"), (False, "two-pass")],
    ids=["x-grad", "x-data", "x-data-first-layer-apart"],
)  # fmt: skip
def test_stack_backward_makes_the_dz_of_each_layer_below(monkeypatch, x_needs_grad, first_layer):
    """The stack's backward runs dx_act for every layer i > 0 (the fused path), layer 1's only where the
    first layer's choice says so when x is data (``_fastest_first``), and its gradients are the layers' one
    by one within the fp32 GEMM tolerance (tests/tolerances.py, "gemm")."""
    calls = []

    def spy(dz, weight, *below):
        calls.append(tuple(weight.shape))
        return dx_act(dz, weight, *below)

    monkeypatch.setattr(linear_act_mod, "dx_act", spy)
    monkeypatch.setattr(linear_act_mod, "fastest_dx", lambda *args: "fused")
    if first_layer is not None:
        monkeypatch.setattr(linear_act_mod, "_fastest_first", lambda *args: first_layer)
    x, weights, biases, dy = _layers(torch.float32)
    x.requires_grad_(x_needs_grad)
    y_stack, grads_stack = _run(linear_act_stack, x, weights, biases, dy)
    first = 2 if first_layer == "two-pass" else 1
    assert calls == [(WIDTHS[i + 1], WIDTHS[i]) for i in reversed(range(first, len(WIDTHS) - 1))]
    _, grads_layers = _run(_one_by_one, x, weights, biases, dy)
    for g_stack, g_layers in zip(grads_stack, grads_layers, strict=True):
        torch.testing.assert_close(g_stack, g_layers, rtol=1e-5, atol=1e-4)


def test_stack_is_one_autograd_node():
    x, weights, biases, _ = _layers(torch.float32)
    y = linear_act_stack(x, weights, biases, ACTIVATIONS)
    assert type(y.grad_fn).__name__ == "_LinearActStackBackward"
    inputs = {fn for fn, _ in y.grad_fn.next_functions if fn is not None}
    assert all(type(fn).__name__ == "AccumulateGrad" for fn in inputs)


def test_stack_rejects_lists_of_different_lengths():
    x, weights, biases, _ = _layers(torch.float32)
    with pytest.raises(ValueError, match="as many weights, biases and activations"):
        linear_act_stack(x, weights, biases[:-1], ACTIVATIONS)
    with pytest.raises(ValueError, match="at least one"):
        linear_act_stack(x, [], [], [])


def test_stack_reports_a_bad_layer_as_linear_act_does():
    x, weights, biases, _ = _layers(torch.float32)
    weights[2] = weights[2][:, :5]  # K = 5 where the previous layer gives 24 columns
    with pytest.raises(ValueError, match="linear_act: weight"):
        linear_act_stack(x, weights, biases, ACTIVATIONS)
