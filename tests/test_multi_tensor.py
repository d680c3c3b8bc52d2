"""kernels/multi_tensor.py: many tensors cast, or stepped by SGD, in one launch, as Tensor.to and
torch._fused_sgd_ give them."""

import pytest
import torch

from kernels.multi_tensor import BLOCK, MAX_TENSORS, cast_together, sgd_step_together

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tensors(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*s, generator=g) * 100).to(DEVICE, dtype) for s in shapes]


# Sizes around the block (one element, a partial block, several blocks and a tail), an empty tensor among
# them, and every slot used.
SHAPES = [(1,), (3, 5), (BLOCK,), (2, BLOCK + 7), (0, 4), (367, 512)]


@pytest.mark.parametrize(
    "src, dst",
    [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float16)],
)
def test_each_result_is_the_tensors_own_cast(src, dst):
    tensors = _tensors(SHAPES, src)
    out = cast_together(tensors, dst)
    for t, o in zip(tensors, out, strict=True):
        assert o.dtype == dst and o.shape == t.shape and o.is_contiguous()
        assert torch.equal(o, t.to(dst))


def test_bf16_rounds_to_nearest_even_with_inf_and_nan_kept():
    """Ties, the largest finite values (rounding up to inf), infinities, NaN, subnormals and signed zeros."""
    words = [0x3F808000, 0x3F818000, 0x3F80C000, 0x7F7FFFFF, 0xFF7F8000, 0x7F800000, 0xFF800000, 0x7FC00001]
    words += [0x00008000, 0x00018000, 0x80000001, 0x80000000, 0x00000000]
    x = torch.tensor(words, dtype=torch.int64).to(torch.int32).view(torch.float32).to(DEVICE)
    (out,) = cast_together([x], torch.bfloat16)
    ref = x.to(torch.bfloat16)
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out[~ref.isnan()].view(torch.int16), ref[~ref.isnan()].view(torch.int16))


def test_all_slots_used():
    tensors = _tensors([(i + 1, 3) for i in range(MAX_TENSORS)], torch.float32, seed=1)
    out = cast_together(tensors, torch.bfloat16)
    assert all(torch.equal(o, t.to(torch.bfloat16)) for t, o in zip(tensors, out, strict=True))


def test_only_empty_tensors():
    out = cast_together(_tensors([(0,), (2, 0)], torch.float32), torch.bfloat16)
    assert [tuple(o.shape) for o in out] == [(0,), (2, 0)] and all(o.dtype == torch.bfloat16 for o in out)


@pytest.mark.parametrize(
    "tensors, message",
    [
        ([], "1 to 16 tensors, got 0"),
        (_tensors([(2,)] * (MAX_TENSORS + 1), torch.float32), "1 to 16 tensors, got 17"),
        ([*_tensors([(2,)], torch.float32), *_tensors([(2,)], torch.bfloat16)], "tensor 1 is torch.bfloat16"),
        (_tensors([(4, 4)], torch.float32)[0].t()[None], "tensor 0 must be contiguous"),
        ([torch.zeros(2, dtype=torch.int64, device=DEVICE)], "dtypes must be among"),
    ],
)
def test_bad_input_is_refused_by_name(tensors, message):
    with pytest.raises(ValueError, match=message):
        cast_together(list(tensors), torch.bfloat16)


def _sgd_pairs(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(*s, generator=g).to(DEVICE) for s in shapes]
    grads = [torch.randn(*s, generator=g).to(DEVICE) for s in shapes]
    return params, grads


def test_sgd_step_is_torchs_fused_sgd_with_the_scaled_rate():
    ours, grads = _sgd_pairs(SHAPES, 3)
    theirs = [p.clone() for p in ours]
    scale = torch.tensor(0.37, device=DEVICE)
    sgd_step_together(ours, grads, 0.05, scale)
    torch._fused_sgd_(
        theirs, grads, [], weight_decay=0.0, momentum=0.0, lr=scale * 0.05, dampening=0.0, nesterov=False,
        maximize=False, is_first_step=False,
    )  # fmt: skip
    # The same product and difference in fp32; a GPU may fuse p - rate * g into one multiply-add on
    # either side, one rounding apart.
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1.2e-7, atol=1e-7)
    assert not torch.equal(ours[-1], _sgd_pairs(SHAPES, 3)[0][-1])  # it moved


@pytest.mark.parametrize(
    "change",
    [
        lambda p, g: (p, g[:-1]),
        lambda p, g: (p, [x.double() for x in g]),
        lambda p, g: ([x.t() for x in p], g),
        lambda p, g: (p * 9, g * 9),
    ],
)
def test_sgd_step_refuses_what_it_cannot_take(change):
    params, grads = change(*_sgd_pairs([(3, 4), (4, 3)], 4))
    with pytest.raises(ValueError, match="1 to 16 fp32 contiguous parameters"):
        sgd_step_together(params, grads, 0.1, torch.tensor(1.0, device=DEVICE))


def test_sgd_step_refuses_a_scale_that_is_not_0d_fp32():
    with pytest.raises(ValueError, match="scale must be a 0-d fp32 tensor"):
        sgd_step_together(*_sgd_pairs([(2,)], 5), 0.1, torch.ones(1, device=DEVICE))


def test_sgd_step_takes_only_tensors_where_triton_runs(monkeypatch):
    """A CPU run without the interpreter has no Triton: its SGD keeps torch's step (dlrm.optim.SGD asks)."""
    import kernels.multi_tensor

    params, grads = _sgd_pairs([(3, 4)], 6)
    assert kernels.multi_tensor.sgd_step_takes(params, grads)
    monkeypatch.setattr(kernels.multi_tensor, "use_triton", lambda t: False)
    assert not kernels.multi_tensor.sgd_step_takes(params, grads)
