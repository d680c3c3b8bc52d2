"""Tests for kernels/cross_net.py: the whole DCNv2 cross network as one op, against L layers of the fp32
PyTorch reference and against L calls of the per-layer op (interpreter on CPU, as tests/test_cross.py)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.cross import cross_layer
from kernels.cross_net import cross_net, cross_net_ref
from tests.test_cross import _assert_fp32_close, _assert_norm_close, _ids, _run, poisoned  # noqa: F401 (a fixture)
from tests.tolerances import tol

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (M, N, r, L): one layer (its x0 gradient also takes g and dh @ V), two (one buffer of the running sum
# each), three (the buffers in turns), primes and non-multiples of the interpreter's 32-wide tiles.
SHAPES = [(1, 1, 1, 1), (3, 7, 5, 2), (37, 45, 7, 3), (70, 100, 33, 3)]
OUTPUTS = ["out", "dx0", "dv", "du", "db"]


def _inputs(m: int, n: int, r: int, layers: int, dtype: torch.dtype, seed: int = 0):
    """x0 [M, N], v [L, r, N], u [L, N, r], b [L, N] and g [M, N] (|z| ~ 1), on DEVICE in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    tensors = (
        torch.randn(m, n, generator=gen),
        torch.randn(layers, r, n, generator=gen) / math.sqrt(n),
        torch.randn(layers, n, r, generator=gen) / math.sqrt(r),
        torch.randn(layers, n, generator=gen),
        torch.randn(m, n, generator=gen),
    )
    return [t.to(device=DEVICE, dtype=dtype) for t in tensors]


def _layer_by_layer(x0, v, u, b):
    """The network as L calls of the per-layer op, the model's way before the network op."""
    x = x0
    for layer in range(v.shape[0]):
        x = cross_layer(x0, x, v[layer], u[layer], b[layer])
    return x


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_forward_and_backward_equal_the_fp32_reference(shape):
    """fp32: the output and the four gradients against autograd through L reference layers (x0's gradient
    summed by autograd there, inside the kernels here)."""
    *inputs, g = _inputs(*shape, torch.float32)
    out, grads = _run(cross_net, inputs, g)
    ref, ref_grads = _run(cross_net_ref, inputs, g)
    _assert_fp32_close(OUTPUTS, [out, *grads], [ref, *ref_grads])


@pytest.mark.parametrize("op", [cross_net, _layer_by_layer], ids=["network", "layers"])
def test_backward_leaves_the_incoming_gradient_as_it_was(op):
    """x_l's gradient g + dh @ V is built on the kernel's copy of autograd's g, never on g itself (another
    consumer of the gradient may hold it), through the network op and through the single-layer op."""
    *inputs, g = _inputs(37, 45, 7, 3, torch.float32)
    kept = g.clone()
    _run(op, inputs, g)
    assert torch.equal(g, kept)


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("shape", SHAPES[2:], ids=_ids)
def test_bf16_equals_the_layers_one_by_one(shape):
    """bf16: the same output and weight gradients as L per-layer ops (the same kernels), and x0's gradient
    within a relative 1e-2 of theirs: here its sum is fp32 inside the kernels, rounded once a layer, there
    each of the L + 1 terms and each add is rounded to bf16 (a few units of 2**-9 each)."""
    *inputs, g = _inputs(*shape, torch.bfloat16)
    out, grads = _run(cross_net, inputs, g)
    ref, ref_grads = _run(_layer_by_layer, inputs, g)
    assert out.dtype == torch.bfloat16 and all(d.dtype == torch.bfloat16 for d in grads)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for name, a, e in zip(OUTPUTS[2:], grads[1:], ref_grads[1:], strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0, msg=name)
    _assert_norm_close(grads[0], ref_grads[0], 1e-2, "dx0")


def test_the_pytorch_fallback_equals_the_reference(monkeypatch):
    """Where the Triton kernels do not run (a CPU without the interpreter), the op's PyTorch bodies: the
    reference's output and gradients."""
    import kernels.cross_net

    monkeypatch.setattr(kernels.cross_net, "use_triton", lambda t: False)
    *inputs, g = _inputs(37, 45, 7, 3, torch.float32)
    out, grads = _run(cross_net, inputs, g)
    ref, ref_grads = _run(cross_net_ref, inputs, g)
    for name, a, e in zip(OUTPUTS, [out, *grads], [ref, *ref_grads], strict=True):
        torch.testing.assert_close(a, e, **tol(torch.float32, "gemm"), msg=name)


def test_empty_batch():
    *inputs, g = _inputs(0, 9, 4, 2, torch.float32)
    out, grads = _run(cross_net, inputs, g)
    assert out.shape == (0, 9) and grads[0].shape == (0, 9)
    assert not grads[3].any() and not grads[1].any()  # db, dv: sums over no rows


def test_bad_inputs_raise_naming_the_values():
    x0, v, u, b, _ = _inputs(3, 7, 5, 2, torch.float32)
    with pytest.raises(ValueError, match=r"v \[L, r, N\], u \[L, N, r\] and b \[L, N\]"):
        cross_net(x0, v, u[:1], b)
    with pytest.raises(ValueError, match=r"u must have shape \(7, 5\)"):
        cross_net(x0, v, u.transpose(1, 2), b)
    with pytest.raises(ValueError, match="v dtype torch.bfloat16 differs"):
        cross_net(x0, v.bfloat16(), u, b)


def test_custom_op_registration():
    """torch.library.opcheck on the forward op: fakes, autograd registration, schema."""
    *inputs, _ = _inputs(5, 9, 3, 2, torch.float32)
    torch.library.opcheck(torch.ops.dlrm.cross_net.default, [t.requires_grad_() for t in inputs])


def test_compiled_equals_eager():
    """Under torch.compile (the custom op in an Inductor graph, batch dynamic): the eager call's output
    and gradients."""
    *inputs, g = _inputs(37, 45, 7, 3, torch.float32)
    compiled = torch.compile(cross_net, dynamic=True, fullgraph=True)
    out, grads = _run(compiled, inputs, g)
    ref, ref_grads = _run(cross_net, inputs, g)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for a, e in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


@pytest.mark.gpu
def test_the_mlperf_network_equals_its_layers_one_by_one_gpu():
    """MLPerf DLRM-DCNv2's network (N = 3456, r = 512, 3 layers) in bf16 on the GPU, the autotuned kernels
    reading the stacked buffers' slices: the per-layer ops' output and weight gradients (the same kernels
    and cuBLAS calls, to the rounding of a GEMM whose algorithm may differ with its output buffer), and
    x0's gradient within the bf16 roundings its L + 1 separate terms take there (1e-2 of the norm)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    m, n, r, layers = 4096, 3456, 512, 3
    inputs = [
        torch.randn(m, n, device="cuda", generator=gen),
        torch.randn(layers, r, n, device="cuda", generator=gen) / math.sqrt(n),
        torch.randn(layers, n, r, device="cuda", generator=gen) / math.sqrt(r),
        torch.randn(layers, n, device="cuda", generator=gen),
    ]
    inputs = [t.bfloat16() for t in inputs]
    g = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    out, grads = _run(cross_net, inputs, g)
    ref, ref_grads = _run(_layer_by_layer, inputs, g)
    _assert_norm_close(out, ref, 1e-3, "out")
    for name, a, e in zip(OUTPUTS[2:], grads[1:], ref_grads[1:], strict=True):
        _assert_norm_close(a, e, 1e-3, name)
    _assert_norm_close(grads[0], ref_grads[0], 1e-2, "dx0")
