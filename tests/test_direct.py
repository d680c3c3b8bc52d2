"""Eager calls of our ops skip the dispatcher (kernels/direct.py) and give what the custom ops give."""

import pytest
import torch

from kernels import bias_act, gated_linear, interaction, linear_act, ln_linear_gelu, lora_linear

M, K, N, R = 37, 24, 16, 4


def _cases():
    """name -> (public function, custom op, inputs, indices of the inputs that take a gradient, output of
    the op that the public function returns)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g)

    x, w, b = t(M, K), t(N, K) / K**0.5, t(N)
    return {
        "linear_act": (linear_act.linear_act, linear_act._linear_act_op, (x, w, b, "gelu_tanh"), (0, 1, 2)),
        "bias_act": (bias_act.bias_act, bias_act._bias_act_op, (t(M, N), b, "silu"), (0, 1)),
        "ln_linear_gelu": (
            ln_linear_gelu.ln_linear_gelu,
            ln_linear_gelu._ln_linear_gelu_op,
            (x, 1 + t(K) / 10, t(K) / 10, w, b, 1e-5),
            (0, 1, 2, 3, 4),
        ),
        "gated_linear": (
            gated_linear.gated_linear,
            gated_linear._gated_linear_op,
            (x, t(2 * N, K) / K**0.5, t(2 * N), "geglu"),
            (0, 1, 2),
        ),
        "lora_linear": (
            lora_linear.lora_linear,
            lora_linear._lora_linear_op,
            (x, w, b, t(R, K) / K**0.5, t(N, R) / R**0.5, 0.5, "relu"),
            (0, 3, 4),  # W and b stay frozen under LoRA: the op gives no gradient for them
        ),
        "dot_interaction": (
            interaction.dot_interaction,
            interaction._interaction_op,
            (t(M, 8), t(M, 5, 8)),
            (0, 1),
        ),
    }


def _run(fn, inputs, grad_at):
    inputs = [
        v.clone().requires_grad_(i in grad_at) if torch.is_tensor(v) else v for i, v in enumerate(inputs)
    ]
    out = fn(*inputs)
    y = out[0] if isinstance(out, tuple) else out
    y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
    return y.detach(), [inputs[i].grad for i in grad_at]


@pytest.mark.parametrize("name", list(_cases()))
def test_eager_calls_skip_the_dispatcher_and_match_the_op(name):
    public, op, inputs, grad_at = _cases()[name]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y, grads = _run(public, inputs, grad_at)
    called = {e.name for e in prof.events() if e.name.startswith("dlrm::")}
    assert called == set(), called  # neither the forward op nor the backward op was dispatched
    y_op, grads_op = _run(op, inputs, grad_at)
    torch.testing.assert_close(y, y_op, rtol=0, atol=0)  # the same kernels on the same inputs
    for got, expected in zip(grads, grads_op, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_torch_compile_still_sees_the_custom_op():
    """Under torch.compile the public function is the custom op (its fake gives shapes to Inductor)."""
    public, _, inputs, grad_at = _cases()["linear_act"]
    compiled = torch.compile(public, backend="aot_eager", fullgraph=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y, grads = _run(compiled, inputs, grad_at)
    called = {e.name for e in prof.events() if e.name.startswith("dlrm::")}
    assert {"dlrm::linear_act", "dlrm::linear_act_backward"} <= called, called
    y_eager, grads_eager = _run(public, inputs, grad_at)
    torch.testing.assert_close(y, y_eager, rtol=0, atol=0)
    for got, expected in zip(grads, grads_eager, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
