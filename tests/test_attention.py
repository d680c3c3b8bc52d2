"""Tests for kernels/attention.py: o = softmax(q k^T / sqrt(d) over the valid keys) v, forward and backward.

On CPU the Triton kernels run in the interpreter (conftest), with IEEE fp32 dots: compared elementwise with
the fp32 reference's autograd gradients. On a GPU (TF32 dots for 16-bit inputs) and for bf16/fp16 the values
are checked as a relative norm (tests/tolerances.py, "gemm_norm").
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.attention as attention_mod
import kernels.gemm.tuning as gemm_tuning
from kernels.attention import (
    masked_attention,
    masked_attention_bwd,
    masked_attention_fwd,
    masked_attention_ref,
)
from tests.test_linear_act import _assert_norm_close, allow_tf32
from tests.tolerances import tol

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (B, H, S, d): ones, primes, DLRM's S = 27 (F + 1) in a 32-wide tile, d not a power of two.
SHAPES = [(1, 1, 1, 1), (3, 2, 7, 5), (2, 3, 27, 16), (1, 1, 17, 33)]


def _ids(s):
    return "x".join(map(str, s))


def _inputs(b, h, s, d, dtype, device=DEVICE, seed=0, p_missing=0.3):
    """q, k, v as [B, H, S, d] views of one [B, S, 3, H, d] projection (as the model makes them), a key
    mask with about `p_missing` keys left out (key 0 always valid), and do."""
    g = torch.Generator().manual_seed(seed)
    qkv = (2 * torch.randn(b, s, 3, h, d, generator=g)).to(device=device, dtype=dtype)
    valid = torch.rand(b, s, generator=g) >= p_missing
    valid[:, 0] = True
    do = torch.randn(b, h, s, d, generator=g).to(device=device, dtype=dtype)
    return qkv, valid.to(device), do


def _split(qkv):
    return tuple(t.transpose(1, 2) for t in qkv.unbind(2))


def _rtol(dtype: torch.dtype) -> float | None:
    """fp16 inputs run their dots in TF32 (as fp32 does under allow_tf32): "gemm_norm"'s 2e-3 covers one
    rounded product, but dq and dk go through three chained ones (scores -> dp -> ds -> dq): seen 2.4e-3 of
    the norm at (3, 2, 7, 5) on an H100, so 5e-3. bf16's 1.6e-2 already covers its coarser inputs."""
    return 5e-3 if dtype == torch.float16 else None


def _check(b, h, s, d, dtype, device=DEVICE, seed=0, p_missing=0.3):
    qkv, valid, do = _inputs(b, h, s, d, dtype, device, seed, p_missing)
    qkv.requires_grad_(True)
    o = masked_attention(*_split(qkv), valid)
    (dqkv,) = torch.autograd.grad(o, qkv, do)
    assert o.dtype == dtype and o.shape == (b, h, s, d)
    qkv32 = qkv.detach().float().requires_grad_(True)
    o32 = masked_attention_ref(*_split(qkv32), valid)
    (dqkv32,) = torch.autograd.grad(o32, qkv32, do.float())
    for got, want, name in ((o, o32, "o"), (dqkv, dqkv32, "dqkv")):
        if dtype == torch.float32 and device == "cpu":
            torch.testing.assert_close(got, want, **tol(dtype, "gemm"), msg=lambda m, n=name: f"{n}: {m}")
        else:
            _assert_norm_close(got, want, dtype, f"{name} {(b, h, s, d)} {dtype}", rtol=_rtol(dtype))


def test_gpu_dot_precision_follows_gemm_tuning(monkeypatch):
    """On a GPU the four products take linear_act's dot precision: fp32 inputs 3xTF32 without allow_tf32 and
    one TF32 product with it, 16-bit inputs one TF32 product."""
    monkeypatch.setattr(attention_mod, "INTERPRETED", False)
    monkeypatch.setattr(gemm_tuning, "INTERPRETED", False)
    for tf32, fp32 in ((False, "tf32x3"), (True, "tf32")):
        with allow_tf32(tf32):
            assert attention_mod._meta(27, 16, torch.float32)["PRECISION"] == fp32
            assert attention_mod._meta(27, 16, torch.bfloat16)["PRECISION"] == "tf32"


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_fwd_bwd_fp32(shape):
    _check(*shape, torch.float32)


def test_reference_is_sdpa_with_a_boolean_key_mask():
    qkv, valid, _ = _inputs(3, 2, 27, 8, torch.float32, "cpu", seed=1)
    q, k, v = _split(qkv)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
    torch.testing.assert_close(masked_attention_ref(q, k, v, valid), sdpa, rtol=1e-5, atol=1e-5)


def test_masked_keys_do_not_matter():
    """Changing the vectors at masked positions changes no valid row's output nor the gradients of the
    valid positions' k and v; the masked positions' k and v get zero gradient."""
    qkv, valid, do = _inputs(2, 2, 9, 4, torch.float32, seed=2, p_missing=0.5)
    q, k, v = _split(qkv)
    k2, v2 = k.clone(), v.clone()
    masked = ~valid[:, None, :, None]
    k2 = torch.where(masked, 100 * torch.randn_like(k), k)
    v2 = torch.where(masked, torch.randn_like(v), v)
    torch.testing.assert_close(masked_attention(q, k2, v2, valid), masked_attention(q, k, v, valid))
    k.requires_grad_(True)
    v.requires_grad_(True)
    dk, dv = torch.autograd.grad(masked_attention(q, k, v, valid), (k, v), do)
    assert not dk.masked_select(masked).any() and not dv.masked_select(masked).any()


def test_a_row_without_valid_keys_gives_zero():
    qkv, valid, do = _inputs(2, 1, 5, 4, torch.float32, seed=3)
    valid[1] = False
    qkv.requires_grad_(True)
    o = masked_attention(*_split(qkv), valid)
    (dqkv,) = torch.autograd.grad(o, qkv, do)
    assert not o[1].any() and not dqkv[1].any() and o[0].abs().sum() > 0
    torch.testing.assert_close(o, masked_attention_ref(*_split(qkv.detach()), valid))


def test_kernels_write_every_element(monkeypatch):
    """Outputs poisoned with NaN before launch: the kernels must write every element."""
    new = attention_mod._new_bshd

    def poisoned(like):
        return new(like).fill_(float("nan"))

    monkeypatch.setattr(attention_mod, "_new_bshd", poisoned)
    qkv, valid, do = _inputs(2, 3, 27, 5, torch.float32, seed=4)
    o, lse = masked_attention_fwd(*_split(qkv), valid)
    grads = masked_attention_bwd(do, *_split(qkv), o, lse, valid)
    assert not any(t.isnan().any() for t in (o, lse, *grads))


def test_output_layout_makes_the_next_layer_input_a_view():
    qkv, valid, _ = _inputs(2, 3, 7, 4, torch.float32, seed=5)
    o = masked_attention(*_split(qkv), valid)
    assert o.stride() == (7 * 3 * 4, 4, 3 * 4, 1)
    assert o.transpose(1, 2).reshape(2, 7, 12).data_ptr() == o.data_ptr()


def test_empty_batch():
    qkv, valid, do = _inputs(0, 2, 5, 4, torch.float32)
    o, lse = masked_attention_fwd(*_split(qkv), valid)
    assert o.shape == (0, 2, 5, 4) and lse.shape == (0, 2, 5)
    assert all(t.shape == (0, 2, 5, 4) for t in masked_attention_bwd(do, *_split(qkv), o, lse, valid))


@pytest.mark.parametrize(
    ("shapes", "valid", "match"),
    [
        (((2, 1, 5, 4), (2, 1, 5, 4), (2, 1, 6, 4)), (2, 5), "must be \\[B, H, S, d\\] of one shape"),
        (((2, 1, 5, 4),) * 3, (2, 4), r"valid must be a \[B, S\] = \[2, 5\] bool tensor"),
        (((2, 1, 200, 4),) * 3, (2, 200), "need 1 <= S <= 128"),
    ],
)
def test_invalid_inputs_raise_value_error(shapes, valid, match):
    with pytest.raises(ValueError, match=match):
        masked_attention(*(torch.randn(*s) for s in shapes), torch.ones(*valid, dtype=torch.bool))


def test_opcheck():
    qkv, valid, _ = _inputs(2, 2, 7, 4, torch.float32, seed=6)
    q, k, v = (t.detach().clone().requires_grad_(True) for t in _split(qkv))
    torch.library.opcheck(torch.ops.dlrm.masked_attention.default, (q, k, v, valid))


def test_cpu_fallback_without_triton(monkeypatch):
    monkeypatch.setattr(attention_mod, "use_triton", lambda x: False)
    _check(3, 2, 27, 8, torch.float32, "cpu", seed=7)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    qkv, valid, do = _inputs(2, 2, 27, 8, torch.float32, seed=8)
    qkv.requires_grad_(True)
    o = torch.compile(lambda t, m: masked_attention(*_split(t), m), fullgraph=True)(qkv, valid)
    (grad,) = torch.autograd.grad(o, qkv, do)
    o_eager = masked_attention(*_split(qkv), valid)
    torch.testing.assert_close(o, o_eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, torch.autograd.grad(o_eager, qkv, do)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fwd_bwd_half(dtype):
    """bf16/fp16 through the kernels (values cast to fp32 right after load, in the interpreter too)."""
    _check(3, 2, 27, 16, dtype, seed=6)
    for shape in SHAPES:
        _check(*shape, dtype)


# ----------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("heads", "dim"), [(2, 16), (4, 32), (2, 64), (8, 128)])
def test_dlrm_shapes_gpu(heads, dim, dtype):
    _check(16384, heads, 27, dim, dtype)
