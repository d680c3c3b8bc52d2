"""Tests for kernels/embedding.py: table-batched lookup with hashing, and the optimizer fused into backward.

The references are PyTorch itself: the lookup against indexing the tables, the updates against
nn.Embedding(sparse=True) + torch.optim.SGD / Adagrad (row-wise Adagrad, which torch.optim lacks, against
its formula in `embedding_update_ref`). On CPU the kernels run in the Triton interpreter (conftest).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels.embedding import embedding_lookup, embedding_lookup_ref
from kernels.embedding_update import OPTIMIZERS, embedding_update, embedding_update_ref, optimizer_state

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KAGGLE_ROWS = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306, 10,
    5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip


def _tables(rows: list[int], d: int, dtype=torch.float32, device=DEVICE, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    weights = torch.randn(sum(rows), d, generator=g, device=device).to(dtype)
    offsets = torch.tensor([0, *rows[:-1]]).cumsum(0).to(device)
    return weights, offsets, torch.tensor(rows, device=device)


def _lr(value: float, device=DEVICE) -> torch.Tensor:
    """The learning rate as the kernels take it: a 0-d fp32 tensor on the tables' device."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def _ids(b: int, rows: list[int], seed: int = 1, device=DEVICE) -> torch.Tensor:
    """Raw ids [B, F]: -1 (missing), the table edges (rows - 2 and rows - 1 map to rows - 1 and 0), and
    random ids up to 3x the rows (wrapping), with repeats since B exceeds small tables."""
    g = torch.Generator().manual_seed(seed)
    r = torch.tensor(rows)
    ids = (torch.rand(b, len(rows), generator=g) * 3 * r).long()
    ids[0] = -1
    if b > 2:
        ids[1], ids[2] = r - 2, r - 1
    return ids.to(device)


@pytest.mark.parametrize("d", [4, 16, 24, 128])
@pytest.mark.parametrize("b", [1, 5, 67])
def test_lookup_is_the_exact_gather(b, d):
    rows = [1, 7, 3, 130, 2]
    weights, offsets, r = _tables(rows, d)
    ids = _ids(b, rows)
    out = embedding_lookup(weights, optimizer_state(weights, "sgd"), offsets, r, ids)
    expected = torch.stack([weights[offsets[f] + (ids[:, f] + 1) % rows[f]] for f in range(len(rows))], dim=1)
    assert out.shape == (b, len(rows), d)
    assert torch.equal(out, expected)  # a gather: bit-exact


def test_index_hashing_takes_rows_as_given():
    rows = [4, 9, 2]
    weights, offsets, r = _tables(rows, 8)
    g = torch.Generator().manual_seed(2)
    within = torch.stack([torch.randint(0, n, (33,), generator=g) for n in rows], dim=1).to(DEVICE)
    out = embedding_lookup(weights, optimizer_state(weights, "sgd"), offsets, r, within, hashing="index")
    assert torch.equal(out, weights[within + offsets])


def _eager_step(rows, weights, ids, grad, optimizer, lr):
    """nn.Embedding(sparse=True) tables + torch.optim: the project's eager path for one step."""
    tables = nn.ModuleList(nn.Embedding(n, weights.shape[1], sparse=True) for n in rows).to(weights.device)
    with torch.no_grad():
        for table, part in zip(tables, weights.split(rows), strict=True):
            table.weight.copy_(part)
    opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adagrad)(tables.parameters(), lr=lr)
    r = torch.tensor(rows, device=ids.device)
    out = torch.stack([t((ids[:, f] + 1) % r[f]) for f, t in enumerate(tables)], dim=1)
    out.backward(grad)
    opt.step()
    new_weights = torch.cat([t.weight.detach() for t in tables])
    if optimizer == "sgd":
        return new_weights, None
    return new_weights, torch.cat([opt.state[t.weight]["sum"] for t in tables])


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("d", [4, 24])
def test_update_matches_torch_optim(optimizer, d):
    rows = [1, 7, 3, 130, 2]
    weights, offsets, r = _tables(rows, d)
    ids = _ids(40, rows)  # tables of 1..7 rows: many repeated ids
    grad = torch.randn(40, len(rows), d, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    expected_w, expected_state = _eager_step(rows, weights.clone(), ids, grad, optimizer, 0.1)

    w = weights.clone().requires_grad_()
    state = optimizer_state(w, optimizer)
    embedding_lookup(w, state, offsets, r, ids, "modulus", optimizer, _lr(0.1)).backward(grad)
    assert w.grad is None  # the update happened in backward; no gradient is left behind
    torch.testing.assert_close(w.detach(), expected_w, rtol=1e-5, atol=1e-6)
    if expected_state is not None:
        torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-6)
    untouched = torch.ones(sum(rows), dtype=torch.bool, device=DEVICE)
    untouched[(ids + 1) % r + offsets] = False
    assert torch.equal(w.detach()[untouched], weights[untouched])


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_bf16_output_from_fp32_tables(optimizer):
    """out_dtype bf16 (what bf16 autocast asks for): the gather rounded once, and the bf16 gradient updates
    the fp32 tables as that gradient in fp32 would."""
    rows = [1, 7, 3, 130, 2]
    weights, offsets, r = _tables(rows, 16)
    ids = _ids(40, rows)
    grad = torch.randn(40, len(rows), 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    grad = grad.to(torch.bfloat16)
    expected_w, _ = _eager_step(rows, weights.clone(), ids, grad.float(), optimizer, 0.1)

    w = weights.clone().requires_grad_()
    state = optimizer_state(w, optimizer)
    out = embedding_lookup(
        w, state, offsets, r, ids, "modulus", optimizer, _lr(0.1), out_dtype=torch.bfloat16
    )
    assert out.dtype == torch.bfloat16
    expected_out = embedding_lookup_ref(weights, offsets, r, ids, "modulus")[0]
    # The interpreter rounds fp32 -> bf16 its own way (truncation); the GPU rounds to nearest.
    torch.testing.assert_close(out.float(), expected_out, rtol=2 * 2**-8, atol=0)
    out.backward(grad)
    torch.testing.assert_close(w.detach(), expected_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("d", [4, 16])
def test_rowwise_adagrad_matches_its_formula(d):
    rows = [3, 50, 1]
    weights, offsets, r = _tables(rows, d)
    ids = _ids(31, rows)
    index = (ids + 1) % r + offsets
    expected_w, expected_state = weights.clone(), optimizer_state(weights, "rowwise_adagrad")
    w, state = weights.clone().requires_grad_(), optimizer_state(weights, "rowwise_adagrad")
    g = torch.Generator().manual_seed(5)
    for _ in range(2):  # the second step reads the first step's state
        grad = torch.randn(31, len(rows), d, generator=g).to(DEVICE)
        embedding_lookup(w, state, offsets, r, ids, "modulus", "rowwise_adagrad", _lr(0.05)).backward(grad)
        embedding_update_ref(expected_w, expected_state, index, grad, "rowwise_adagrad", _lr(0.05), 1e-10)
    torch.testing.assert_close(w.detach(), expected_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-6)
    assert state.shape == (sum(rows),) and bool((state[index.flatten()] > 0).all())


def test_update_ref_sums_repeated_rows_before_adagrad():
    """Adagrad is not additive: two lookups of one row must count as one gradient (g1 + g2)."""
    w, state = torch.zeros(2, 1), torch.zeros(2, 1)
    embedding_update_ref(
        w, state, torch.tensor([1, 1]), torch.tensor([[1.0], [2.0]]), "adagrad", _lr(1.0, "cpu"), 0.0
    )
    assert state[1].item() == 9.0 and w[1].item() == pytest.approx(-1.0)


def test_errors_name_the_problem():
    weights, offsets, r = _tables([3, 4], 4)
    state = optimizer_state(weights, "sgd")
    with pytest.raises(ValueError, match=r"ids must be \[B, 2\] int64"):
        embedding_lookup(weights, state, offsets, r, torch.zeros(3, 5, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="unknown hashing"):
        embedding_lookup(weights, state, offsets, r, _ids(2, [3, 4]), hashing="xor")
    with pytest.raises(ValueError, match="unknown embedding optimizer"):
        optimizer_state(weights, "adam")
    with pytest.raises(ValueError, match="adagrad state must be"):
        embedding_update(weights, torch.zeros(7), torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, 4),
                         "adagrad", _lr(0.1), 1e-10)  # fmt: skip
    with pytest.raises(ValueError, match="weights dtype"):
        embedding_lookup(weights.double(), state, offsets, r, _ids(2, [3, 4]))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_update_reads_the_lr_tensor(optimizer):
    """The kernels load lr from its tensor: the value written into that one tensor between steps (as a
    schedule does, before each CUDA graph replay) is the one applied; lr 0 leaves the weights as they
    were, and the update is linear in lr (same gradient, same state)."""
    rows = [1, 7, 3, 130, 2]
    weights, offsets, r = _tables(rows, 8)
    ids = _ids(40, rows)
    grad = torch.randn(40, len(rows), 8, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    lr, deltas = _lr(0.5), {}
    for value in (0.0, 0.1, 0.3):
        lr.fill_(value)  # the same tensor each time, written in place
        w, state = weights.clone().requires_grad_(), optimizer_state(weights, optimizer)
        embedding_lookup(w, state, offsets, r, ids, "modulus", optimizer, lr).backward(grad)
        deltas[value] = w.detach() - weights
    assert torch.equal(deltas[0.0], torch.zeros_like(weights))
    assert deltas[0.1].abs().max() > 0
    torch.testing.assert_close(deltas[0.3], 3 * deltas[0.1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("shape", [(), (1,)])
def test_update_op_with_tensor_lr_matches_the_reference(optimizer, shape):
    """torch.ops.dlrm.embedding_update takes the lr as a tensor ([] or [1]) and equals the reference."""
    rows = [3, 50, 1]
    weights, offsets, r = _tables(rows, 16)
    ids = _ids(31, rows)
    index = (ids + 1) % r + offsets
    grad = torch.randn(31, len(rows), 16, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    lr = torch.full(shape, 0.07, device=DEVICE)
    w, state = weights.clone(), optimizer_state(weights, optimizer)
    expected_w, expected_state = weights.clone(), optimizer_state(weights, optimizer)
    torch.ops.dlrm.embedding_update(w, state, index, grad, optimizer, lr, 1e-10)
    embedding_update_ref(expected_w, expected_state, index, grad, optimizer, lr, 1e-10)
    torch.testing.assert_close(w, expected_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-6)
    # The fake (meta) registrations take the tensor lr too, so torch.compile can trace the ops.
    torch.library.opcheck(
        torch.ops.dlrm.embedding_update,
        (weights.clone(), optimizer_state(weights, optimizer), index, grad, optimizer, lr, 1e-10),
        test_utils=("test_schema", "test_faketensor"),
    )
    state = optimizer_state(weights, optimizer)
    args = (weights.clone(), state, offsets, r, ids, "modulus", optimizer, lr, 1e-10, torch.float32)
    torch.library.opcheck(
        torch.ops.dlrm.embedding_lookup, args, test_utils=("test_schema", "test_faketensor")
    )


def test_lr_must_be_a_one_element_fp32_tensor():
    rows = [3, 4]
    weights, offsets, r = _tables(rows, 4)
    w, state, ids = weights.clone().requires_grad_(), optimizer_state(weights, "sgd"), _ids(2, rows)
    for bad, got in ((0.1, "got 0.1"), (_lr(0.1).double(), "torch.float64"), (torch.ones(2), r"\[2\]")):
        with pytest.raises(ValueError, match=f"lr must be a one-element fp32 tensor on .*{got}"):
            embedding_lookup(w, state, offsets, r, ids, "modulus", "sgd", bad)
    with pytest.raises(ValueError, match="lr is required when backward updates the weights"):
        embedding_lookup(w, state, offsets, r, ids)
    with torch.no_grad():  # lookups only: no lr needed
        assert torch.equal(
            embedding_lookup(w, state, offsets, r, ids),
            embedding_lookup_ref(weights, offsets, r, ids, "modulus")[0],
        )


def _exact_row_sums(
    inverse: torch.Tensor, grad: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums, bound), [rows, D] float64: each touched row's gradient sum, exact (float64), and how far an
    fp32 sum of the same terms in any order (atomics, index_add_) may fall from it: 8 u sqrt(n) ||g_i||_2
    (u = 2^-24, n the row's hits), eight times the spread of the random walk of roundings (~u n sigma for n
    terms of size sigma). fp32 sums of the Kaggle test's ids and gradients, in two orders, came within
    0.36 of it (`test_summation_bound_covers_fp32_sums_in_any_order`); a term more or less in a hot row
    exceeds it (the mutants of `test_skewed_ids_update_within_summation_error`, tried by hand)."""
    d = grad.shape[-1]
    flat, inv = grad.reshape(-1, d).double(), inverse.reshape(-1)
    sums = torch.zeros(rows, d, dtype=torch.float64, device=grad.device).index_add_(0, inv, flat)
    squares = torch.zeros_like(sums).index_add_(0, inv, flat * flat)
    hits = torch.bincount(inv, minlength=rows).double()
    return sums, 8 * 2.0**-24 * hits.sqrt()[:, None] * squares.sqrt()


def _assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """|got - want| <= bound + 1e-6 |want| elementwise (1e-6: the few fp32 roundings after the sums)."""
    error = (got - want).abs()
    excess = (error - bound - 1e-6 * want.abs()).flatten()
    worst = int(excess.argmax())
    assert excess[worst] <= 0, (
        f"{what}: off by {error.flatten()[worst]:.3g} where {bound.flatten()[worst]:.3g} is allowed"
    )


def _skewed_ids(r: torch.Tensor, b: int, g: torch.Generator) -> torch.Tensor:
    """Raw ids [b, F] for tables of r rows, skewed to the low rows (u^4, u uniform): a table's first rows
    take most of the batch, as hot ids do."""
    u = torch.rand(b, len(r), device=r.device, generator=g, dtype=torch.float64) ** 4
    return (u * r).long() - 1


def _check_update_against_exact(rows: list[int], b: int, d: int, optimizer: str, device: str) -> None:
    """Lookup of skewed ids (hot rows repeat up to thousands of times) exact; one fused update within fp32
    summation error of the exact update, computed in float64 from the exact row sums. The kernel updates
    the tables in place: no reference copy of them (at Kaggle size and D = 128, 17 GB each)."""
    weights, offsets, r = _tables(rows, d, device=device)
    g = torch.Generator(device=device).manual_seed(7)
    ids = _skewed_ids(r, b, g)
    out_ref, index = embedding_lookup_ref(weights, offsets, r, ids, "modulus")
    touched, inverse = index.flatten().unique(return_inverse=True)
    before = weights[touched].double()
    state = optimizer_state(weights, optimizer)
    lr = 0.01
    out = embedding_lookup(
        weights.requires_grad_(), state, offsets, r, ids, "modulus", optimizer, _lr(lr, device)
    )
    assert torch.equal(out, out_ref)
    grad = torch.randn(out.shape, device=device, generator=g)
    out.backward(grad)
    sums, bound = _exact_row_sums(inverse, grad, len(touched))
    after = weights.detach()[touched].double()
    rounding = 2.0**-22 * (before.abs() + after.abs())  # of w - step in fp32
    if optimizer == "sgd":
        # The kernel adds each -lr g_k into the weight by an atomic add: n roundings at |w|'s scale, a
        # random walk bounded the same way (8 u sqrt(n) |w|) on top of the sum's error.
        hits = torch.bincount(inverse.flatten(), minlength=len(touched)).double()[:, None]
        step = lr * sums
        step_bound = lr * bound + 8 * 2.0**-24 * hits.sqrt() * torch.maximum(before.abs(), after.abs())
    elif optimizer == "adagrad":  # from a zero state: state = g^2, step = lr g / (|g| + eps)
        _assert_within(state[touched].double().sqrt(), sums.abs(), bound, "sqrt(Adagrad state) vs |g|")
        step = lr * sums / (sums.abs() + 1e-10)
        # A sum within rounding of zero may take either sign: its step is then +-lr.
        step_bound = torch.where(sums.abs() <= bound, 2 * lr, 0.0)
    else:  # state = mean(g^2) per row, step = lr g / rms(g)
        rms, rms_bound = sums.square().mean(1).sqrt(), bound.square().mean(1).sqrt()
        _assert_within(state[touched].double().sqrt(), rms, rms_bound, "sqrt(row-wise state) vs rms(g)")
        assert (rms > 2 * rms_bound).all()  # the bound below divides by rms - rms_bound
        step = lr * sums / rms[:, None]
        # |(g + e) / (rms + e_r) - g / rms| <= (|e| rms + |g| |e_r|) / (rms (rms - |e_r|))
        step_bound = lr * (bound * rms[:, None] + sums.abs() * rms_bound[:, None])
        step_bound = step_bound / (rms * (rms - rms_bound))[:, None]
    _assert_within(before - after, step, step_bound + rounding, f"{optimizer} step")


def test_summation_bound_covers_fp32_sums_in_any_order():
    """The premise of `_exact_row_sums`' bound, on the Kaggle test's ids and gradients (D = 16): fp32 sums
    of each row's terms, in file order and in a random order, both stay within it."""
    g = torch.Generator().manual_seed(7)
    r = torch.tensor(KAGGLE_ROWS)
    rows = (_skewed_ids(r, 16384, g) + 1) % r + torch.tensor([0, *KAGGLE_ROWS[:-1]]).cumsum(0)
    touched, inverse = rows.flatten().unique(return_inverse=True)
    grad = torch.randn(rows.numel(), 16, generator=g)
    sums, bound = _exact_row_sums(inverse, grad, len(touched))
    for order in (torch.arange(len(inverse)), torch.randperm(len(inverse), generator=g)):
        fp32 = torch.zeros(len(touched), 16).index_add_(0, inverse[order], grad[order])
        _assert_within(fp32.double(), sums, bound, "an fp32 sum")


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_skewed_ids_update_within_summation_error(optimizer):
    """The Kaggle test's check, small: hot rows of tiny tables hit by most of the batch."""
    _check_update_against_exact([3, 4, 10, 1000, 5000], 512, 16, optimizer, DEVICE)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_row_longer_than_several_blocks_takes_one_summed_step(optimizer):
    """At D = 128 a block holds 32 sorted lookups: the one-row table's 200 lookups span seven blocks, whose
    partial sums meet in one slot, and the 7-row table's runs cross block edges too."""
    _check_update_against_exact([1, 7, 1000], 200, 128, optimizer, DEVICE)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("chunk", [32, 64, 256])
def test_a_row_longer_than_a_level_of_blocks_takes_one_summed_step(optimizer, chunk, monkeypatch):
    """The one-row table's 1,500 lookups span 47 chunks of 32 sorted positions at level 0: their 47 partial
    sums cross the blocks of the next level too, whose partials a third level sums; in chunks of 64 and 256
    (the default) fewer levels, the row's sum carried from block to block within a chunk."""
    import kernels.embedding_update as eu

    monkeypatch.setattr(eu, "CROSSING_CHUNK", chunk)
    _check_update_against_exact([1, 7, 1000], 1500, 16, optimizer, DEVICE)


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
def test_persistent_programs_that_take_many_blocks_step_the_same(optimizer, monkeypatch):
    """Three programs for every persistent kernel: each summing program walks some thirty blocks (each one's
    positions loaded while the block before is summed, the last prefetch past the list), each step program
    many groups of segments; the update stays within fp32 summation error of the exact one."""
    import kernels.embedding_update as eu

    monkeypatch.setattr(eu, "_persistent_grid", lambda items, per_sm, device: min(items, 3))
    _check_update_against_exact([1, 7, 1000], 1500, 16, optimizer, DEVICE)


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("short", [32, 64, 10**6])
@pytest.mark.parametrize("chunk", [32, 256])
def test_short_and_long_segments_take_the_same_summed_step(optimizer, short, chunk, monkeypatch):
    """Segments of at most SHORT_SEGMENT positions are summed by the step kernel's loop, longer ones by
    the summing kernel, whose blocks without a long segment end at once: with the 40-row table's rows near
    the threshold (~37 lookups each, some short, some long at 32 and 64) and every segment short (a
    million: the one-row table's 1,500 lookups in one loop), the update stays within fp32 summation error
    of the exact one."""
    import kernels.embedding_update as eu

    monkeypatch.setattr(eu, "SHORT_SEGMENT", short)
    monkeypatch.setattr(eu, "CROSSING_CHUNK", chunk)
    _check_update_against_exact([1, 7, 40, 1000], 1500, 16, optimizer, DEVICE)


@pytest.mark.parametrize("chunk", [32, 64])
def test_level_zero_sums_only_the_chunks_of_long_segments(chunk, monkeypatch):
    """Level 0 gives a place in the next level to the partial sums of the long segments that cross a chunk's
    edge only, and the summing kernel's list holds exactly the chunks (of CROSSING_CHUNK sorted positions)
    that hold a long segment, in order: against a count by hand of segments around SHORT_SEGMENT = 32
    positions, with a run of short segments that fills whole chunks."""
    import kernels.embedding_update as eu

    monkeypatch.setattr(eu, "CROSSING_CHUNK", chunk)
    lengths = [1, 40, 3, 33, 2, 100, 1, 32, 5, 70, 2, 2] + [1, 3] * 60 + [32, 2, 40]
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    n = len(segment)
    starts = torch.full((n + 1,), n)
    starts[: len(lengths)] = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    dest, next_segment, places, blocks, count = eu._level_plan(segment.to(DEVICE), n, starts.to(DEVICE), None)
    long = {s for s, length in enumerate(lengths) if length > eu.SHORT_SEGMENT}
    expected = [k for k in range(-(-n // chunk)) if long & set(segment[k * chunk : (k + 1) * chunk].tolist())]
    assert len(expected) < -(-n // chunk)  # some chunk holds short segments only
    assert blocks[: int(count)].tolist() == expected
    ends = starts[1 : len(lengths) + 1] - 1
    crossing = {s for s in long if int(starts[s]) // chunk != int(ends[s]) // chunk}
    assert set(next_segment[: int(places)].tolist()) == crossing  # the others are summed in their chunk
    assert (next_segment[int(places) :] >= n).all()  # the unused places: segments of their own


def _level_plan_by_torch(segment, segments, starts, used, block_n, short):
    """`_level_plan`'s outputs by torch operations on the whole arrays, each its definition: the flags of
    every block, their places by a prefix sum, a scatter of the flagged segments."""
    m = len(segment)
    begins = torch.arange(0, m, block_n)
    ends = (begins + block_n - 1).clamp(max=m - 1)
    first, last = segment[begins], segment[ends]
    came_in = (begins > 0) & (segment[(begins - 1).clamp(min=0)] == first)
    goes_on = (ends + 1 < m) & (segment[(ends + 1).clamp(max=m - 1)] == last) & ~(came_in & (first == last))
    if starts is not None:
        came_in &= starts[first + 1] - starts[first] > short
        goes_on &= starts[last + 1] - starts[last] > short
    flags = torch.stack([came_in, goes_on], dim=1).reshape(-1)
    places = torch.cumsum(flags, dim=0) - 1
    dest = torch.where(flags, places, -1)
    next_segment = segments + torch.arange(len(flags) + 1)
    pairs = torch.stack([first, last], 1).reshape(-1)
    next_segment.scatter_(0, torch.where(flags, places, len(flags)), pairs)
    k = len(begins)
    if used is None:
        long = starts[segment + 1] - starts[segment] > short  # of each position
        listed = torch.stack([long[b : b + block_n].any() for b in begins.tolist()])
        blocks, count = torch.arange(k)[listed], int(listed.sum())
    else:
        blocks, count = torch.arange(k), -(-int(used) // block_n)
    return dest, next_segment[:-1], int(places[-1]) + 1, blocks[:count], count


@pytest.mark.parametrize("level0", [True, False])
@pytest.mark.parametrize("m", [1, 31, 32, 33, 64, 500, 3000])
def test_a_levels_plan_is_its_definition(level0, m):
    """`_level_plan`'s two kernels and scan give what the definitions give on the whole arrays (by torch):
    for sorted segments of lengths 1 to 80 (short, long, across block edges, inside one block), at level 0
    (long segments only, the listed blocks) and at a level >= 1 (its first blocks up to the used places)."""
    import kernels.embedding_update as eu

    generator = torch.Generator().manual_seed(m + 7 * level0)
    lengths = torch.randint(1, 81, (m,), generator=generator)
    segment = torch.repeat_interleave(torch.arange(m), lengths)[:m]  # m positions
    segments = int(segment[-1]) + 1
    starts = None
    if level0:
        starts = torch.full((m + 1,), m)
        starts[:segments] = torch.searchsorted(segment, torch.arange(segments))
    used = None if level0 else torch.tensor([max(1, m - 5)])
    block_n = eu.CROSSING_CHUNK if level0 else eu.SUM_BLOCK_N
    expected = _level_plan_by_torch(segment, segments, starts, used, block_n, eu.SHORT_SEGMENT)
    on = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    dest, next_segment, places, blocks, count = eu._level_plan(on(segment), segments, on(starts), on(used))
    assert dest.cpu().tolist() == expected[0].tolist()
    assert next_segment.cpu().tolist() == expected[1].tolist()
    assert int(places) == expected[2] and int(count) == expected[4]
    assert blocks[: int(count)].cpu().tolist() == expected[3].tolist()


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
def test_the_sums_never_read_an_unused_place(optimizer, monkeypatch):
    """The sums' buffers are not zeroed: with them full of NaN (what uninitialized memory may hold) the
    update is the same bits as with zeros, so no unused place of a level reaches a sum (a 0/1 matrix times
    NaN) and no short segment's slot is read."""
    import kernels.embedding_update as eu

    weights, offsets, r = _tables([1, 7, 1000], 16, device=DEVICE)
    ids = _ids(1500, [1, 7, 1000], seed=5, device=DEVICE)
    index = (ids + 1) % r + offsets
    grad = torch.randn(*ids.shape, 16, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    results = []
    for fill in (0.0, float("nan")):
        monkeypatch.setattr(
            eu, "_sums_buffer", lambda n, d, device, fill=fill: torch.full((n, d), fill, device=device)
        )
        w, state = weights.clone(), optimizer_state(weights, optimizer)
        embedding_update(w, state, index, grad, optimizer, _lr(0.1), 1e-10)
        results.append((w, state))
    assert not results[1][0].isnan().any()
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_sgd_in_order_sums_without_atomics_and_takes_the_same_step(monkeypatch):
    """`in_order`: SGD on fp32 weights goes down the sorted path (the atomic kernel refuses to run here) and
    steps each row by its summed gradient, as the atomic adds do (within fp32 summation order), repeated
    rows of small tables included."""
    import kernels.embedding_update as eu

    weights, offsets, r = _tables([3, 50, 1000], 16, device=DEVICE)
    ids = _ids(600, [3, 50, 1000], seed=9, device=DEVICE)
    index = (ids + 1) % r + offsets
    grad = torch.randn(*ids.shape, 16, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    atomic = weights.clone()
    embedding_update(atomic, optimizer_state(atomic, "sgd"), index, grad, "sgd", _lr(0.1), 1e-10)

    class Refused:
        def __getitem__(self, grid):
            raise AssertionError("in_order went through the atomic adds")

    monkeypatch.setattr(eu, "_sgd_kernel", Refused())
    in_order = weights.clone()
    embedding_update(
        in_order, optimizer_state(in_order, "sgd"), index, grad, "sgd", _lr(0.1), 1e-10, in_order=True
    )
    assert not torch.equal(in_order, weights)
    # The atomic adds round the weight at each of a small table's ~200 lookups a row, in whatever order a
    # GPU's threads come: ~sqrt(200) half-ulps of a weight near 1, a few 1e-6.
    torch.testing.assert_close(in_order, atomic, rtol=1e-5, atol=1e-5)


def test_sgd_at_a_small_batch_spreads_its_rows_and_updates_alike(monkeypatch):
    """A small batch's SGD atomics run over more programs of fewer samples (SGD_PROGRAMS): the update equals
    the one of block_sizes's 256-sample programs within fp32 summation order (those sum a small table's
    lookups a block at a time before their atomic add: SGD_HOT_BATCH), repeated rows included."""
    import kernels.embedding_update as eu

    weights, offsets, r = _tables([3, 50, 1000], 16)
    ids = _ids(128 * 9, [3, 50, 1000], seed=7)  # 1,152 x 3 lookups, the small tables' rows repeated
    index = (ids + 1) % r + offsets
    grad = torch.randn(*ids.shape, 16, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    results = []
    for programs in (eu.SGD_PROGRAMS, 1):
        monkeypatch.setattr(eu, "SGD_PROGRAMS", programs)
        w = weights.clone()
        embedding_update(w, optimizer_state(w, "sgd"), index, grad, "sgd", _lr(0.1), 1e-10)
        results.append(w)
    assert not torch.equal(results[0], weights)
    # The 3-row table's ~380 lookups a row, summed in two orders: ~sqrt(380) half-ulps of a step near 2.
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bags", [False, True])
@pytest.mark.parametrize("hot_rows", [16, 32])
def test_sgd_sums_a_small_tables_lookups_then_adds_them_to_the_rows_looked_up(monkeypatch, hot_rows, bags):
    """The SGD kernel's blocks of one column whose rows span fewer than SGD_HOT_ROWS sum each row's lookups
    before adding them (blocks of 256 samples here: SGD_PROGRAMS 1, SGD_HOT_BATCH 1). A 20-row table takes
    that path at 32 and the plain atomic adds at 16 (a block spans its rows); both take the reference's
    step, and the rows no lookup read, held at -0.0, keep their sign (an added zero would make them +0.0),
    one-hot lookups and bags alike."""
    import kernels.embedding_update as eu
    from kernels.embedding_bag import embedding_bag_update, embedding_bag_update_ref

    monkeypatch.setattr(eu, "SGD_HOT_ROWS", hot_rows)
    monkeypatch.setattr(eu, "SGD_PROGRAMS", 1)
    monkeypatch.setattr(eu, "SGD_HOT_BATCH", 1)
    rows, sizes = [3, 20, 1000], [1, 2, 3] if bags else [1, 1, 1]
    weights, offsets, r = _tables(rows, 16)
    columns = torch.cat([torch.full((k,), f) for f, k in enumerate(sizes)])
    ids = _ids(512, [rows[f] for f in columns.tolist()], seed=3)
    index = ((ids + 1) % r[columns] + offsets[columns]).to(DEVICE)
    unread = torch.ones(len(weights), dtype=torch.bool, device=DEVICE)
    unread[index.reshape(-1)] = False
    assert unread[offsets[2] :].any() and not unread[: offsets[2]].any()
    weights[unread] = -0.0
    g = torch.Generator().manual_seed(4)
    grad = torch.randn(512, len(sizes) if bags else len(rows), 16, generator=g).to(DEVICE)
    ours, expected = weights.clone(), weights.clone()
    if bags:
        k = torch.tensor(sizes, device=DEVICE)
        embedding_bag_update(ours, torch.zeros(0), index, grad, k, "sum", "sgd", _lr(0.1), 0.0)
        embedding_bag_update_ref(expected, torch.zeros(0), index, grad, k, "sum", "sgd", _lr(0.1), 0.0)
    else:
        embedding_update(ours, torch.zeros(0), index, grad, "sgd", _lr(0.1), 0.0)
        embedding_update_ref(expected, torch.zeros(0), index, grad, "sgd", _lr(0.1), 0.0)
    assert not torch.equal(ours, weights)
    # The 3-row table's ~170 (x1 or x3) lookups a row summed in another order than the reference's.
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    assert torch.signbit(ours[unread]).all()


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_bf16_weights(optimizer):
    """bf16 weights (fp32 state): the update is computed in fp32 and rounded once, like the reference (in the
    interpreter too: the kernel casts to fp32 right after the load)."""
    rows = [5, 1000, 3]
    weights, offsets, r = _tables(rows, 16, dtype=torch.bfloat16, device=DEVICE)
    ids = _ids(300, rows, device=DEVICE)
    w = weights.clone().requires_grad_()
    state = optimizer_state(w, optimizer)
    out = embedding_lookup(w, state, offsets, r, ids, "modulus", optimizer, _lr(0.1))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, embedding_lookup_ref(weights, offsets, r, ids, "modulus")[0])
    grad = torch.randn(out.shape, device=DEVICE).to(torch.bfloat16)  # what autograd hands a bf16 output
    out.backward(grad)
    expected_state = optimizer_state(weights, optimizer)
    embedding_update_ref(weights, expected_state, (ids + 1) % r + offsets, grad, optimizer, _lr(0.1), 1e-10)
    # Both sides round the fp32 update once to bf16 (only the fp32 summation order differs): <= 1 ulp.
    torch.testing.assert_close(w.detach(), weights, rtol=1.6e-2, atol=1e-5)


# ----------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("d", [16, 128])
def test_kaggle_cardinalities_on_gpu(d, optimizer):
    """Kaggle tables (33.8M rows; at D = 128 4.3G elements, past int32 offsets), B=16384: lookup exact,
    update within fp32 summation error. (It compared with the fp32 reference before: Adagrad's state,
    g^2, of a hot row whose thousands of terms cancel to |g| ~ 0.3 is off by ~2 |g| u n sigma, past
    rtol 1e-3 in 1 of 6 orders simulated on CPU; and the reference's copies took 70 GB at D = 128.)"""
    _check_update_against_exact(KAGGLE_ROWS, 16384, d, optimizer, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
def test_the_update_is_the_same_bits_on_every_run_gpu(optimizer):
    """Hot rows of tiny tables span hundreds of blocks of sorted lookups, whose partial sums an atomic add
    would take in the order the programs finish: the level-by-level sums take them in a fixed order, so
    two updates of the same tables by the same gradients give the same bits."""
    rows = [3, 4, 10, 1000, 5000]
    weights, offsets, r = _tables(rows, 128, device="cuda")
    ids = _skewed_ids(r, 16384, torch.Generator(device="cuda").manual_seed(3))
    grad = torch.randn(
        *ids.shape, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4)
    )
    index = (ids + 1) % r + offsets
    results = []
    for _ in range(2):
        w, state = weights.clone(), optimizer_state(weights, optimizer)
        embedding_update(w, state, index, grad, optimizer, _lr(0.01, "cuda"), 1e-10)
        results.append((w, state))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
