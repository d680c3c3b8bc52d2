"""Tests for kernels/cuda/bias_act.py: y = act(x + b) in CUDA C++, forward and backward.

The kernel needs a CUDA GPU and nvcc; on CPU these tests check the one-line errors and, where nvcc is on the
PATH, that the device code compiles. The numerical tests are GPU-only (`gpu` marker).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

import kernels.cuda.bias_act as cuda_mod
from kernels.activations import ACTIVATIONS
from kernels.cuda.bias_act import bias_act_cuda, bias_act_cuda_bwd, bias_act_cuda_ref
from tests.tolerances import tol

# N a multiple of 16 bytes' elements takes the vectorized backward (4099x512, 5x16 with lanes past N), the
# others the scalar one.
SHAPES = [(1, 1), (3, 7), (127, 65), (300, 257), (4099, 512), (5, 16)]


def test_cpu_tensors_raise_one_line():
    with pytest.raises(ValueError, match="bias_act_cuda: needs CUDA tensors"):
        bias_act_cuda(torch.randn(3, 4), torch.randn(4))


def test_build_errors_are_one_line(monkeypatch):
    monkeypatch.setattr(cuda_mod, "_MODULE", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="bias_act_cuda: needs a CUDA GPU"):
        cuda_mod._module()
    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp, "CUDA_HOME", None)
    with pytest.raises(ValueError, match="bias_act_cuda: needs nvcc"):
        cuda_mod._module()


def test_invalid_inputs_raise_value_error():
    with pytest.raises(ValueError, match=r"bias must have shape \[N\] = \[4\]"):
        bias_act_cuda(torch.randn(3, 4), torch.randn(5))
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        bias_act_cuda(torch.randn(3, 4), torch.randn(4), "tanh")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_device_code_compiles_with_nvcc(tmp_path):
    """The kernels (every dtype x activation instantiated through the host entry points) compile."""
    source = tmp_path / "bias_act.cu"
    source.write_text(
        cuda_mod.DEVICE_SOURCE
        + "\nvoid* entry_points[] = {(void*)&dlrm_bias_act::fwd, (void*)&dlrm_bias_act::bwd};\n"
    )
    result = subprocess.run(
        ["nvcc", "-std=c++17", "-O3", "-arch=sm_90", "-c", str(source), "-o", str(tmp_path / "bias_act.o")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


# ----------------------------------------------------------------------------------------------- GPU


def _inputs(m, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, b, dy = torch.randn(m, n, generator=g), torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    return tuple(t.to("cuda", dtype) for t in (x, b, dy))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fwd_bwd_gpu(activation, dtype):
    for m, n in SHAPES:
        x, b, dy = _inputs(m, n, dtype, seed=m)
        x.requires_grad_(True)
        b.requires_grad_(True)
        y = bias_act_cuda(x, b, activation)
        dx, db = torch.autograd.grad(y, (x, b), dy)
        x32, b32 = (t.detach().float().requires_grad_(True) for t in (x, b))
        y32 = bias_act_cuda_ref(x32, b32, activation)
        dx32, db32 = torch.autograd.grad(y32, (x32, b32), dy.float())
        torch.testing.assert_close(y, y32.to(dtype), **tol(dtype, "fwd"))
        torch.testing.assert_close(dx.float(), dx32, **tol(dtype, "grad"))
        torch.testing.assert_close(db.float(), db32, **tol(dtype, "sum"))


@pytest.mark.gpu
def test_agrees_with_the_triton_bias_act_gpu():
    from kernels.bias_act import bias_act_bwd, bias_act_fwd

    x, b, dy = _inputs(16384, 512, torch.bfloat16, seed=1)
    # Both round one fp32 value to bf16, but their exp differs in the last fp32 bits (Triton's tl.exp is the
    # approximate ex2, CUDA's expf is not): seen 30 of 8.4M outputs one bf16 ulp apart (H100). Within 1 ulp.
    torch.testing.assert_close(
        bias_act_cuda(x, b, "gelu_tanh"), bias_act_fwd(x, b, "gelu_tanh"), **tol(torch.bfloat16, "fwd")
    )
    for got, want in zip(bias_act_cuda_bwd(dy, x, b, "relu"), bias_act_bwd(dy, x, b, "relu"), strict=True):
        torch.testing.assert_close(got.float(), want.float(), **tol(torch.bfloat16, "sum"))


@pytest.mark.gpu
def test_opcheck_gpu():
    x, b, _ = _inputs(5, 11, torch.float32, seed=2)
    torch.library.opcheck(
        torch.ops.dlrm.bias_act_cuda.default, (x.requires_grad_(), b.requires_grad_(), "silu")
    )


@pytest.mark.gpu
def test_cuda_graph_capture_gpu():
    x, b, _ = _inputs(1000, 300, torch.float32, seed=3)
    y = bias_act_cuda(x, b, "relu")  # build and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = bias_act_cuda(x, b, "relu")
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(y, bias_act_cuda_ref(x, b, "relu"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_unaligned_rows_take_the_scalar_backward_gpu(dtype):
    """Contiguous inputs whose data starts one element past 16 bytes (N = 512 would take the vectorized
    backward): the scalar kernel's results."""
    m, n = 1000, 512
    x, b, dy = _inputs(m, n, dtype, seed=4)
    shifted = [torch.empty(m * n + 1, device="cuda", dtype=dtype)[1:].view(m, n).copy_(t) for t in (x, dy)]
    assert shifted[0].data_ptr() % 16 != 0
    dx, db = bias_act_cuda_bwd(shifted[1], shifted[0], b, "gelu_tanh")
    x32, b32 = (t.float().requires_grad_(True) for t in (x, b))
    dx32, db32 = torch.autograd.grad(bias_act_cuda_ref(x32, b32, "gelu_tanh"), (x32, b32), dy.float())
    torch.testing.assert_close(dx.float(), dx32, **tol(dtype, "grad"))
    torch.testing.assert_close(db.float(), db32, **tol(dtype, "sum"))


@pytest.mark.gpu
def test_int64_offsets_gpu():
    x = torch.randn(2**22 + 3, 513, device="cuda", dtype=torch.bfloat16)  # M * N > 2**31
    b = torch.randn(513, device="cuda", dtype=torch.bfloat16)
    y = bias_act_cuda(x, b, "sigmoid")
    torch.testing.assert_close(y[-3:], bias_act_cuda_ref(x[-3:], b, "sigmoid"), **tol(torch.bfloat16, "fwd"))


def test_config_takes_the_cuda_kernel():
    from dlrm.config import from_dict

    cfg = from_dict({"train": {"use_triton": True, "triton_mlp_kernel": "cuda_bias_act"}})
    assert cfg.mlp_kernel == "cuda_bias_act"


@pytest.mark.gpu
def test_training_with_the_cuda_kernel_follows_eager_gpu(criteo_sample, tmp_path):
    """train.triton_mlp_kernel "cuda_bias_act", with and without the whole-step CUDA graph, gives eager's
    loss curve."""
    from tests.test_train import _loss_curves

    kernel = {"use_triton": True, "triton_mlp_kernel": "cuda_bias_act"}
    curves = _loss_curves(
        criteo_sample,
        tmp_path,
        {
            "eager": {},
            "cuda": {**kernel, "cuda_graphs": False},
            "cuda_graphs": {**kernel, "cuda_graphs": True},
        },
    )
    for name in ("cuda", "cuda_graphs"):
        torch.testing.assert_close(curves[name], curves["eager"], rtol=1e-4, atol=1e-5, msg=name)


def test_a_lock_left_by_a_stopped_build_is_removed(monkeypatch, tmp_path):
    """torch waits without end while the build's lock file exists: one older than STALE_LOCK_S (a build
    stopped midway left it) is removed with a warning before the build; a younger one (a build running
    now) is left alone."""
    import os
    import time

    import torch.utils.cpp_extension as cpp

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cuda_mod, "_MODULE", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp, "CUDA_HOME", "/usr/local/cuda")
    lock_at_build = []
    monkeypatch.setattr(cpp, "load_inline", lambda **kwargs: lock_at_build.append(lock.exists()) or "module")
    lock = tmp_path / cuda_mod._NAME / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    old = time.time() - cuda_mod.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with pytest.warns(UserWarning, match="removing .*lock, left 11 min ago by a build that was stopped"):
        assert cuda_mod._module() == "module"
    monkeypatch.setattr(cuda_mod, "_MODULE", None)
    lock.touch()  # now: a build in progress
    assert cuda_mod._module() == "module"
    assert lock_at_build == [False, True]
