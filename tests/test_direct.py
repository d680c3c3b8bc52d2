"""Eager calls of our ops skip the dispatcher (kernels/op.py) and give what the custom ops give."""

import pytest
import torch

from kernels import (
    attention,
    bias_act,
    embedding,
    embedding_update,
    gated_linear,
    interaction,
    linear_act,
    ln_linear_gelu,
    lora_linear,
    loss,
)

M, K, N, R = 37, 24, 16, 4


def _cases():
    """name -> (public function, custom op, inputs, indices of the inputs that take a gradient, output of
    the op that the public function returns)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g)

    x, w, b = t(M, K), t(N, K) / K**0.5, t(N)
    return {
        "linear_act": (linear_act.linear_act, torch.ops.dlrm.linear_act, (x, w, b, "gelu_tanh"), (0, 1, 2)),
        "bias_act": (bias_act.bias_act, torch.ops.dlrm.bias_act, (t(M, N), b, "silu"), (0, 1)),
        "ln_linear_gelu": (
            ln_linear_gelu.ln_linear_gelu,
            torch.ops.dlrm.ln_linear_gelu,
            (x, 1 + t(K) / 10, t(K) / 10, w, b, 1e-5),
            (0, 1, 2, 3, 4),
        ),
        "gated_linear": (
            gated_linear.gated_linear,
            torch.ops.dlrm.gated_linear,
            (x, t(2 * N, K) / K**0.5, t(2 * N), "geglu"),
            (0, 1, 2),
        ),
        "lora_linear": (
            lora_linear.lora_linear,
            torch.ops.dlrm.lora_linear,
            (x, w, b, t(R, K) / K**0.5, t(N, R) / R**0.5, 0.5, "relu"),
            (0, 3, 4),  # W and b stay frozen under LoRA: the op gives no gradient for them
        ),
        "dot_interaction": (
            interaction.dot_interaction,
            torch.ops.dlrm.dot_interaction,
            (t(M, 8), t(M, 5, 8)),
            (0, 1),
        ),
        "masked_attention": (
            attention.masked_attention,
            torch.ops.dlrm.masked_attention,
            (t(3, 2, 6, 8), t(3, 2, 6, 8), t(3, 2, 6, 8), torch.rand(3, 6, generator=g) < 0.7),
            (0, 1, 2),
        ),
        "bce_with_logits": (
            loss.bce_with_logits,
            torch.ops.dlrm.bce_with_logits,
            (t(M), (torch.rand(M, generator=g) < 0.3).float()),
            (0,),
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


def test_the_embedding_lookup_updates_the_tables_alike_without_the_dispatcher():
    """The lookup's backward applies the optimizer to the tables in place (no gradient): the eager path
    looks up and updates exactly as the custom ops do, and dispatches neither."""
    g = torch.Generator().manual_seed(1)
    rows = torch.tensor([5, 9, 3])
    weights = torch.randn(int(rows.sum()), 8, generator=g)
    offsets = torch.cumsum(rows, 0) - rows
    ids = torch.randint(-1, 50, (M, 3), generator=g)
    lr = torch.tensor(0.1)

    def run(lookup):
        w = weights.clone().requires_grad_(True)
        state = embedding_update.optimizer_state(w, "adagrad")
        out = lookup(w, state, offsets, rows, ids, "modulus", "adagrad", lr, 1e-10, w.dtype)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
        return out.detach(), w.detach(), state

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        eager = run(embedding.embedding_lookup)
    called = {e.name for e in prof.events() if e.name.startswith("dlrm::")}
    assert called == set(), called
    through_ops = run(torch.ops.dlrm.embedding_lookup)
    assert not torch.equal(eager[1], weights)  # the backward did update the tables
    for got, expected in zip(eager, through_ops, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
