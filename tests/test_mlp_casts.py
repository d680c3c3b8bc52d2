"""dlrm.model.mlp under autocast: the "linear_act" stack casts its fp32 weights and biases to the autocast
dtype together (one launch each way, kernels/multi_tensor.py), with the values and gradients that a cast a
tensor gives."""

import torch

from dlrm.model.mlp import MLP, _cast_together

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _leaves(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (7,), (1, 7), (1,)]
    return [torch.randn(*s, generator=g).to(DEVICE).requires_grad_() for s in shapes]


def test_cast_together_equals_a_cast_a_tensor_forward_and_backward():
    ours, theirs = _leaves(0), _leaves(0)
    out = _cast_together(torch.bfloat16, ours)
    ref = [t.to(torch.bfloat16) for t in theirs]
    assert all(o.dtype == torch.bfloat16 and torch.equal(o, r) for o, r in zip(out, ref, strict=True))
    g = torch.Generator().manual_seed(1)
    upstream = [torch.randn(r.shape, generator=g).to(DEVICE, torch.bfloat16) for r in ref]
    torch.autograd.backward(out, upstream)
    torch.autograd.backward(ref, upstream)
    for a, b in zip(ours, theirs, strict=True):
        assert a.grad.dtype == torch.float32 and torch.equal(a.grad, b.grad)


def test_tensors_already_in_the_dtype_pass_through():
    tensors = [t.detach().to(torch.bfloat16) for t in _leaves(2)]
    assert all(a is b for a, b in zip(_cast_together(torch.bfloat16, tensors), tensors, strict=True))


def test_linear_act_mlp_under_bf16_autocast_as_with_a_cast_a_tensor(monkeypatch):
    """The Triton stack casting together gives the bits of the same stack casting each tensor alone: output
    (bf16) and the fp32 gradients of every weight and bias."""
    import dlrm.model.mlp as mlp_module

    x = torch.randn(32, 6, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    runs = []
    for together in (True, False):
        if not together:
            monkeypatch.setattr(mlp_module, "_cast_together", lambda dtype, ts: [t.to(dtype) for t in ts])
        torch.manual_seed(0)
        mlp = MLP(6, (16, 8, 1), last_activation="identity", kernel="linear_act").to(DEVICE)
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            y = mlp(x)
        y.float().square().sum().backward()
        runs.append((y, [p.grad for p in mlp.parameters()]))
    (y, grads), (y_ref, grads_ref) = runs
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    assert all(g.dtype == torch.float32 and torch.equal(g, r) for g, r in zip(grads, grads_ref, strict=True))


def test_each_way_is_one_launch_of_the_cast_kernel(monkeypatch):
    """Where our Triton kernels run (the GPU; the CPU under the tests' interpreter), the casts are
    kernels.multi_tensor's, one call forward and one backward."""
    import kernels.multi_tensor

    calls = []
    real = kernels.multi_tensor.cast_together
    monkeypatch.setattr(
        kernels.multi_tensor, "cast_together", lambda ts, dtype: calls.append(dtype) or real(ts, dtype)
    )
    out = _cast_together(torch.bfloat16, _leaves(4))
    torch.autograd.backward(out, [torch.ones_like(o) for o in out])
    assert calls == [torch.bfloat16, torch.float32]
