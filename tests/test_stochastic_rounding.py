"""The stochastic rounding of bf16 tables in the fused embedding updates (kernels/embedding_update.py):
unbiased, one of the two neighbouring bf16 values, fresh bits for every count, the same bits for the same
(seed, count), through the one-id lookup's and the bags' backward. On CPU the kernels run in the Triton
interpreter (conftest); the reference draws its bits from a torch.Generator instead of the kernels' hash,
so both are held to the same properties rather than compared bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.embedding import embedding_lookup
from kernels.embedding_bag import embedding_bag_lookup
from kernels.embedding_update import embedding_update, embedding_update_ref, optimizer_state

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
UPDATES = {"kernel": embedding_update, "reference": embedding_update_ref}


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(toward zero, away from zero): the two bf16 values around fp32 `x` (equal where x is one), as fp32."""
    pattern = x.float().contiguous().view(torch.int32)
    low = pattern & -(1 << 16)
    high = torch.where(low == pattern, low, low + (1 << 16))
    return low.view(torch.float32), high.view(torch.float32)


def _rounding(seed: int, count: int = 0) -> torch.Tensor:
    return torch.tensor([seed, count], dtype=torch.int64, device=DEVICE)


def _draws(update, value: float, delta: float, seed: int, count: int, rows: int = 64, d: int = 32):
    """rows * d draws of bf16(value) + delta rounded stochastically: one SGD step of lr 1 and gradient
    -delta on every element of a [rows, d] bf16 table holding `value` (a bf16 value)."""
    weights = torch.full((rows, d), value, dtype=torch.bfloat16, device=DEVICE)
    grad = torch.full((rows, d), -delta, device=DEVICE)
    index = torch.arange(rows, device=DEVICE)
    lr = torch.ones((), device=DEVICE)
    update(weights, optimizer_state(weights, "sgd"), index, grad, "sgd", lr, 0.0, _rounding(seed, count))
    return weights.float()


@pytest.mark.parametrize("how", list(UPDATES))
@pytest.mark.parametrize(
    ("value", "delta"),
    [(1.0, 2.0**-10), (1.0, 3 * 2.0**-9), (-3.0, -(2.0**-9) / 3), (0.015625, 2.0**-16 * 0.7)],
)
def test_unbiased_and_one_of_the_two_neighbours(how, value, delta):
    """The mean over 4 x 2048 draws of one fp32 value lies within 4 standard errors of it (rounding to
    nearest would sit at one neighbour, tens of standard errors away), and each draw is one of its two
    neighbouring bf16 values."""
    exact = torch.tensor(value + delta, dtype=torch.float32)  # exact in fp32: a short binary fraction
    low, high = (t.item() for t in _neighbours(exact))
    assert low != high  # the value lies strictly between two bf16 values
    draws = torch.cat([_draws(UPDATES[how], value, delta, 7, count).flatten() for count in range(4)])
    assert bool(((draws == low) | (draws == high)).all())
    p = (exact.item() - low) / (high - low)  # the probability of `high`
    standard_error = abs(high - low) * math.sqrt(p * (1 - p) / draws.numel())
    assert abs(draws.double().mean().item() - exact.item()) < 4 * standard_error


@pytest.mark.parametrize("how", list(UPDATES))
def test_fresh_bits_for_each_count_and_the_same_for_the_same_seed(how):
    update = UPDATES[how]
    first = _draws(update, 1.0, 2.0**-8, seed=3, count=0)
    assert torch.equal(first, _draws(update, 1.0, 2.0**-8, seed=3, count=0))
    # p = 1/2: two independent draws of 2048 elements agree on about half of them.
    for other in (
        _draws(update, 1.0, 2.0**-8, seed=3, count=1),
        _draws(update, 1.0, 2.0**-8, seed=4, count=0),
    ):
        assert 0.3 < (first == other).double().mean().item() < 0.7


@pytest.mark.parametrize("how", list(UPDATES))
def test_neighbouring_elements_draw_apart(how):
    """p = 1/2: any two columns of a row (neighbouring elements of the kernel's hash) agree on about half
    of the 64 rows, as independent draws do."""
    draws = _draws(UPDATES[how], 1.0, 2.0**-8, seed=5, count=0)
    for a, b in ((0, 1), (0, 7), (3, 4), (0, 8)):
        assert 0.2 < (draws[:, a] == draws[:, b]).double().mean().item() < 0.8, (a, b)


def test_exact_values_and_nan_stay_as_they_are():
    """An update that leaves a bf16 value exact (a zero gradient: a skipped non-finite step) rounds to
    itself whatever the bits; NaN stays NaN (a negative NaN's pattern plus the bits could wrap to zero)."""
    weights = torch.randn(16, 8, device=DEVICE).to(torch.bfloat16)
    weights[3, 2], weights[5, 1] = float("nan"), -float("nan")
    before = weights.clone()
    state, index = optimizer_state(weights, "adagrad"), torch.arange(16, device=DEVICE)
    lr, grad = torch.ones((), device=DEVICE), torch.zeros(16, 8, device=DEVICE)
    for count in range(3):
        embedding_update(weights, state, index, grad, "adagrad", lr, 1e-10, _rounding(1, count))
    assert torch.equal(weights.isnan(), before.isnan())
    assert torch.equal(weights[~before.isnan()], before[~before.isnan()])


def _within_one_bf16_step(got: torch.Tensor, want: torch.Tensor) -> None:
    """got (bf16) is a neighbour of the fp32 update `want`: within one bf16 spacing of it (the fp32
    updates of kernel and reference differ by a few fp32 roundings, far below a bf16 step)."""
    low, high = _neighbours(want)
    spacing = (high - low).abs().clamp_min(want.abs() * 2.0**-8)
    assert bool(((got.float() - want).abs() <= spacing * (1 + 1e-3)).all())


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_lookup_backward_rounds_stochastically(optimizer):
    """One-id lookups with repeated rows: the bf16 tables after backward are neighbours of the fp32
    update, and the same step with the next count lands elsewhere."""
    rows, d, b = [3, 11, 5], 16, 23
    g = torch.Generator().manual_seed(0)
    start = torch.randn(sum(rows), d, generator=g).to(torch.bfloat16).to(DEVICE)
    offsets = torch.tensor([0, 3, 14], device=DEVICE)
    r = torch.tensor(rows, device=DEVICE)
    ids = torch.randint(-1, 30, (b, 3), generator=g).to(DEVICE)
    grad = torch.randn(b, 3, d, generator=g).to(DEVICE)
    lr = torch.tensor(0.01, device=DEVICE)
    want, want_state = start.float(), optimizer_state(start, optimizer)
    index = (ids + 1) % r + offsets
    embedding_update_ref(want, want_state, index, grad, optimizer, lr, 1e-10)
    results = []
    for count in (0, 1):
        w, state = start.clone().requires_grad_(), optimizer_state(start, optimizer)
        out = embedding_lookup(w, state, offsets, r, ids, "modulus", optimizer, lr, 1e-10, torch.float32,
                               rounding=_rounding(5, count))  # fmt: skip
        assert out.dtype == torch.float32 and torch.equal(out, start.float()[index])  # bf16 rows, exact
        out.backward(grad)
        _within_one_bf16_step(w.detach(), want)
        results.append(w.detach())
    assert not torch.equal(results[0], results[1])


def test_bag_backward_rounds_stochastically():
    rows, sizes, d, b = [7, 4], [3, 2], 8, 9
    g = torch.Generator().manual_seed(1)
    start = torch.randn(sum(rows), d, generator=g).to(torch.bfloat16).to(DEVICE)
    offsets, r = torch.tensor([0, 7], device=DEVICE), torch.tensor(rows, device=DEVICE)
    bag_sizes = torch.tensor(sizes, device=DEVICE)
    ids = torch.randint(-1, 20, (b, sum(sizes)), generator=g).to(DEVICE)
    grad = torch.randn(b, 2, d, generator=g).to(DEVICE)
    lr = torch.tensor(0.01, device=DEVICE)
    w, state = start.clone().requires_grad_(), optimizer_state(start, "adagrad")
    out = embedding_bag_lookup(w, state, offsets, r, bag_sizes, ids, "modulus", "sum", "adagrad", lr, 1e-10,
                               torch.float32, _rounding(2, 9))  # fmt: skip
    out.backward(grad)
    want, want_state = start.float(), optimizer_state(start, "adagrad")
    features = torch.tensor([0, 0, 0, 1, 1], device=DEVICE)
    index = (ids + 1) % r[features] + offsets[features]
    embedding_update_ref(want, want_state, index, grad.index_select(1, features), "adagrad", lr, 1e-10)
    _within_one_bf16_step(w.detach(), want)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-6)


def test_rounding_must_be_two_int64_on_the_tables_device():
    weights = torch.zeros(4, 2, dtype=torch.bfloat16, device=DEVICE)
    for bad in (torch.zeros(2, device=DEVICE), torch.zeros(3, dtype=torch.int64, device=DEVICE)):
        with pytest.raises(ValueError, match=r"rounding must be a \[2\] int64 tensor \(seed, count\)"):
            embedding_update(weights, optimizer_state(weights, "sgd"), torch.zeros(1, dtype=torch.int64,
                             device=DEVICE), torch.zeros(1, 2, device=DEVICE), "sgd",
                             torch.ones((), device=DEVICE), 0.0, bad)  # fmt: skip
