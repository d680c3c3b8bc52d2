"""kernels.embedding_bag (Triton interpreter on CPU) against its fp32 PyTorch references and against an
independent eager reference: nn.EmbeddingBag with torch.optim on its sparse gradient."""

import pytest
import torch
from torch import nn

from kernels.embedding_bag import (
    bag_columns,
    embedding_bag_lookup,
    embedding_bag_lookup_ref,
    embedding_bag_update,
    embedding_bag_update_ref,
)
from kernels.embedding_update import embedding_update_ref, optimizer_state

# (batch, bag sizes, rows per table, D): a batch of 1, a prime batch and width, bags of 1 and of many.
SHAPES = [
    (1, [1], [3], 1),
    (7, [3, 1, 2], [5, 7, 4], 5),
    (37, [1, 9, 2, 4], [11, 2, 61, 1], 19),
]
# bf16 weights: the kernels cast to fp32 after each load, the reference computes in fp32; both round the
# result once to bf16 (one ulp, 2**-8 relative, apart at most where the fp32 sums differ in the last bit).
TOLERANCES = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2}}


def _tables(batch, sizes, rows, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows_t, sizes_t = torch.tensor(rows), torch.tensor(sizes)
    offsets = torch.cumsum(rows_t, 0) - rows_t
    weights = torch.randn(sum(rows), d, generator=g).to(dtype)
    # Ids in a range a few times the rows: repeats inside and across bags, and missing ids (-1).
    ids = torch.randint(-1, 3 * max(rows), (batch, sum(sizes)), generator=g)
    return weights, offsets, rows_t, sizes_t, ids, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("shape", SHAPES)
def test_pooled_lookup_equals_the_reference(shape, pooling, dtype):
    weights, offsets, rows, sizes, ids, _ = _tables(*shape, dtype)
    out = embedding_bag_lookup(weights, torch.zeros(0), offsets, rows, sizes, ids, pooling=pooling)
    expected, _ = embedding_bag_lookup_ref(weights, offsets, rows, sizes, ids, "modulus", pooling)
    assert out.shape == (shape[0], len(shape[1]), shape[3]) and out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    # The reference itself, against a per-bag loop.
    start = sum(shape[1][:1])
    bag = (ids[0, start : start + shape[1][1]] + 1) % rows[1] + offsets[1] if len(shape[1]) > 1 else None
    if bag is not None:
        pooled = weights[bag].float().sum(0) / (len(bag) if pooling == "mean" else 1)
        torch.testing.assert_close(expected[0, 1].float(), pooled, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_update_equals_the_reference(shape, optimizer, dtype):
    weights, offsets, rows, sizes, ids, g = _tables(*shape, dtype, seed=1)
    state = optimizer_state(weights, optimizer)
    if optimizer != "sgd":
        state += torch.rand(state.shape, generator=g)  # a state from earlier steps
    _, index = embedding_bag_lookup_ref(weights, offsets, rows, sizes, ids, "modulus", "mean")
    grad = torch.randn(shape[0], len(shape[1]), shape[3], generator=g)
    lr = torch.tensor(0.1)
    got_w, got_s = weights.clone(), state.clone()
    embedding_bag_update(got_w, got_s, index, grad, sizes, "mean", optimizer, lr, 1e-8)
    ref_w, ref_s = weights.clone(), state.clone()
    embedding_bag_update_ref(ref_w, ref_s, index, grad, sizes, "mean", optimizer, lr, 1e-8)
    torch.testing.assert_close(got_w, ref_w, **TOLERANCES[dtype])
    torch.testing.assert_close(got_s, ref_s, rtol=1e-5, atol=1e-5)
    touched = torch.zeros(len(weights), dtype=torch.bool)
    touched[index.reshape(-1)] = True
    assert torch.equal(got_w[~touched], weights[~touched])  # only looked-up rows change
    assert not torch.equal(got_w[touched], weights[touched])


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_a_row_in_many_bags_takes_one_step_with_its_summed_gradient(optimizer, pooling):
    """FBGEMM's EXACT semantics: row 0 of a table sits in every one of 40 bags (several times in some), the
    rest of each bag is random: the fused backward must equal ONE optimizer step with the gradient summed
    over the batch, as torch.optim does on nn.EmbeddingBag's sparse gradient (coalesced), and not 40+
    steps of the single gradients."""
    torch.manual_seed(3)
    batch, k, rows, d = 40, 5, 13, 6
    ids = torch.randint(0, rows, (batch, k))
    ids[:, 0] = rows - 1  # hashes to row 0: (x + 1) mod rows
    ids[::3, 2] = rows - 1  # twice in every third bag
    bag = nn.EmbeddingBag(rows, d, mode=pooling, sparse=True)
    weights = bag.weight.detach().clone()
    grad = torch.randn(batch, 1, d)
    lr, eps = 0.3, 1e-8

    fused_w = weights.clone()
    fused_s = optimizer_state(fused_w, optimizer)
    fused_w.requires_grad_(True)
    out = embedding_bag_lookup(
        fused_w, fused_s, torch.tensor([0]), torch.tensor([rows]), torch.tensor([k]), ids,
        pooling=pooling, optimizer=optimizer, lr=torch.tensor(lr), eps=eps,
    )  # fmt: skip
    out.backward(grad)
    assert fused_w.grad is None  # updated in place, no gradient

    # Independent reference: the summed sparse gradient of nn.EmbeddingBag, one step.
    bag(torch.remainder(ids + 1, rows)).backward(grad[:, 0])
    g = bag.weight.grad.coalesce().to_dense()
    if optimizer == "sgd":
        expected = weights - lr * g
    elif optimizer == "adagrad":
        optim = torch.optim.Adagrad([bag.weight], lr=lr, eps=eps)
        optim.step()
        expected = bag.weight.detach()
    else:
        state = (g * g).mean(dim=1, keepdim=True)
        expected = weights - lr * g / (state.sqrt() + eps)
    torch.testing.assert_close(fused_w.detach(), expected, rtol=1e-5, atol=1e-6)
    if optimizer != "sgd":
        # One step per lookup instead (what the EXACT semantics rule out) lands elsewhere for row 0.
        one_by_one = weights[0].clone()
        per_lookup = grad[:, 0] / (k if pooling == "mean" else 1)
        acc = torch.zeros(d if optimizer == "adagrad" else 1)
        for b in range(batch):
            for _ in range(1 + (b % 3 == 0)):
                acc += per_lookup[b] ** 2 if optimizer == "adagrad" else (per_lookup[b] ** 2).mean()
                one_by_one -= lr * per_lookup[b] / (acc.sqrt() + eps)
        assert (one_by_one - expected[0]).abs().max() > 1e-3


def test_bad_arguments_raise_one_line():
    weights, offsets, rows, sizes, ids, _ = _tables(*SHAPES[1], torch.float32)
    with pytest.raises(ValueError, match="unknown pooling 'max'"):
        embedding_bag_lookup(weights, torch.zeros(0), offsets, rows, sizes, ids, pooling="max")
    with pytest.raises(ValueError, match="unknown embedding optimizer 'adam'"):
        embedding_bag_lookup(weights, torch.zeros(0), offsets, rows, sizes, ids, optimizer="adam")
    with pytest.raises(ValueError, match=r"bag_sizes must be a \[F\] int64 tensor"):
        embedding_bag_lookup(weights, torch.zeros(0), offsets, rows, sizes[:2], ids)
    with pytest.raises(ValueError, match="lr is required"):
        embedding_bag_lookup(weights.requires_grad_(True), torch.zeros(0), offsets, rows, sizes, ids)


@pytest.mark.parametrize(("optimizer", "dtype", "in_order"), [
    ("sgd", torch.float32, False), ("sgd", torch.float32, True), ("adagrad", torch.float32, False),
    ("rowwise_adagrad", torch.bfloat16, False),
])  # fmt: skip
@pytest.mark.parametrize("last_row_lookups", [3, 200])  # a short segment, and one the summing kernels take
def test_drop_last_row_steps_the_other_rows_as_if_its_lookups_were_not_there(
    last_row_lookups, optimizer, dtype, in_order
):
    """drop_last_row (a row shard's padding row): the last row and its state stay as they are, and every
    other row takes the one-id reference's step on the lookups left once the last row's are taken out
    (a long segment of other rows in the same chunks as the dropped ones; SGD by atomics and in order)."""
    _check_drop_last_row(64, last_row_lookups, optimizer, dtype, in_order, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize(("optimizer", "dtype", "in_order"), [
    ("sgd", torch.float32, False), ("sgd", torch.float32, True), ("adagrad", torch.float32, False),
    ("rowwise_adagrad", torch.bfloat16, False),
])  # fmt: skip
def test_drop_last_row_on_the_gpu(optimizer, dtype, in_order):
    """The same on a GPU, where the dropped lookups fill many chunks of the summing kernels."""
    _check_drop_last_row(4096, 20_000, optimizer, dtype, in_order, "cuda")


def _check_drop_last_row(batch, last_row_lookups, optimizer, dtype, in_order, device):
    sizes, rows, d = [3, 5], [40, 300], 8
    weights, offsets, rows_t, sizes_t, ids, g = _tables(batch, sizes, rows, d, dtype, seed=3)
    index = (torch.rand(batch, sum(sizes), generator=g) ** 2 * sum(rows)).long()  # hot low rows
    last = sum(rows) - 1
    index.view(-1)[torch.randperm(index.numel(), generator=g)[:last_row_lookups]] = last
    state = optimizer_state(weights, optimizer)
    if optimizer != "sgd":
        state += torch.rand(state.shape, generator=g)
    grad = torch.randn(batch, len(sizes), d, generator=g)
    weights, sizes_t, index, state, grad = (t.to(device) for t in (weights, sizes_t, index, state, grad))
    lr = torch.tensor(0.1, device=device)
    got_w, got_s = weights.clone(), state.clone()
    embedding_bag_update(
        got_w, got_s, index, grad, sizes_t, "mean", optimizer, lr, 1e-8, in_order=in_order, drop_last_row=True
    )
    assert torch.equal(got_w[last], weights[last])
    assert optimizer == "sgd" or torch.equal(got_s[last], state[last])
    features, scales = bag_columns(sizes_t, "mean", index.shape[1])
    per_lookup = (grad.index_select(1, features) * scales[:, None]).reshape(-1, d)
    kept = index.reshape(-1) != last
    ref_w, ref_s = weights.clone(), state.clone()
    embedding_update_ref(ref_w, ref_s, index.reshape(-1)[kept], per_lookup[kept], optimizer, lr, 1e-8)
    torch.testing.assert_close(got_w, ref_w, **TOLERANCES[dtype])
    torch.testing.assert_close(got_s, ref_s, rtol=1e-5, atol=1e-5)
    # The PyTorch reference drops them too.
    bag_w, bag_s = weights.clone(), state.clone()
    embedding_bag_update_ref(bag_w, bag_s, index, grad, sizes_t, "mean", optimizer, lr, 1e-8, None, True)
    torch.testing.assert_close(bag_w, ref_w, **TOLERANCES[dtype])
    torch.testing.assert_close(bag_s, ref_s, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("optimizer", "dtype"), [("sgd", torch.float32), ("adagrad", torch.float32),
                                                ("rowwise_adagrad", torch.bfloat16)])  # fmt: skip
def test_a_gradient_view_updates_as_its_contiguous_copy(optimizer, dtype):
    """The pooled gradient as the slice of a concatenation's gradient (strides [(F + 1) D, D, 1], as the
    "dcn" interaction hands it back) is read in place: the same update, bit for bit, as its copy."""
    batch, sizes, rows, d = SHAPES[2]
    weights, offsets, rows_t, sizes_t, ids, g = _tables(batch, sizes, rows, d, dtype)
    _, index = embedding_bag_lookup_ref(weights, offsets, rows_t, sizes_t, ids, "modulus", "mean")
    grad = torch.randn(batch, len(sizes) + 1, d, generator=g)[:, 1:]
    assert not grad.is_contiguous()
    results = []
    for g_in in (grad, grad.contiguous()):
        w, state = weights.clone(), optimizer_state(weights, optimizer)
        embedding_bag_update(w, state, index, g_in, sizes_t, "mean", optimizer, torch.tensor(0.1), 1e-8)
        results.append((w, state))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    assert not torch.equal(results[0][0], weights)


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])  # sgd's update sums no segments
def test_32_and_64_bit_gather_offsets_give_the_same_update(optimizer, monkeypatch):
    """The summing kernel gathers the gradient with 32-bit offsets where its elements fit, else 64-bit
    ones: with the limit at 0 (every gather 64-bit) the update is the same bits, for a gradient view."""
    import kernels.embedding_update as eu

    batch, sizes, rows, d = SHAPES[2]
    weights, offsets, rows_t, sizes_t, ids, g = _tables(batch, sizes, rows, d, torch.float32)
    _, index = embedding_bag_lookup_ref(weights, offsets, rows_t, sizes_t, ids, "modulus", "sum")
    grad = torch.randn(batch, len(sizes) + 1, d, generator=g)[:, 1:]
    results = []
    for limit in (eu.OFFSET32_LIMIT, 0):
        monkeypatch.setattr(eu, "OFFSET32_LIMIT", limit)
        w, state = weights.clone(), optimizer_state(weights, optimizer)
        embedding_bag_update(w, state, index, grad, sizes_t, "sum", optimizer, torch.tensor(0.1), 1e-8)
        results.append((w, state))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    assert not torch.equal(results[0][0], weights)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_a_bf16_gradient_sums_as_its_fp32_value_gpu(pooling, optimizer):
    """A bf16 pooled gradient (what a bf16 step hands the backward) goes into one bf16 dot a block, its
    mean scale applied after the sum: each row's state and weights within the fp32 summation bound of
    the exact (fp64) step on the same gradient. Skewed ids: rows in thousands of bags, sums that cross
    many blocks, where any order of fp32 sums (the kernel's, the reference's atomics) differs in the
    last bits, so the bound, not another fp32 order, is the reference."""
    batch, sizes, rows, d = 4096, [3, 1, 20, 2], [5, 1000, 50_000, 7], 128
    weights, offsets, rows_t, sizes_t, _, g = _tables(batch, sizes, rows, d, torch.float32, seed=2)
    ids = (torch.rand(batch, sum(sizes), generator=g) ** 3 * 3 * max(rows)).long()
    weights, offsets, rows_t, sizes_t, ids = (t.cuda() for t in (weights, offsets, rows_t, sizes_t, ids))
    state = optimizer_state(weights, optimizer) + 1.0  # a state from earlier steps
    _, index = embedding_bag_lookup_ref(weights, offsets, rows_t, sizes_t, ids, "modulus", pooling)
    grad = torch.randn(batch, len(sizes), d, device="cuda").to(torch.bfloat16)
    lr, eps = 0.1, 1e-8
    got_w, got_s = weights.clone(), state.clone()
    embedding_bag_update(got_w, got_s, index, grad, sizes_t, pooling, optimizer, torch.tensor(lr).cuda(), eps)
    # The exact step in fp64, and Higham's bound on a sum of n fp32 terms, |error| <= n u sum|term|
    # (u = 2**-24; Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 4.4), carried through
    # state + g^2 and lr g / sqrt(state), plus one rounding of each stored fp32 result.
    u = 2.0**-24
    features, scales = bag_columns(sizes_t, pooling, index.shape[1])
    terms = (grad.double().index_select(1, features) * scales.double()[:, None]).reshape(-1, d)
    touched, inverse = torch.unique(index.reshape(-1), return_inverse=True)
    exact_g = torch.zeros(len(touched), d, dtype=torch.float64, device="cuda").index_add_(0, inverse, terms)
    abs_sum = torch.zeros_like(exact_g).index_add_(0, inverse, terms.abs())
    count = torch.bincount(inverse, minlength=len(touched)).double()[:, None]
    g_bound = count * u * abs_sum + u * exact_g.abs()  # the sum's, then the scale's rounding
    g2, g2_bound = exact_g**2, 2 * exact_g.abs() * g_bound + g_bound**2
    if optimizer == "rowwise_adagrad":
        g2, g2_bound = g2.mean(1), g2_bound.mean(1)
    exact_s = state[touched].double() + g2
    s_bound = g2_bound + 2 * u * exact_s
    assert ((got_s[touched].double() - exact_s).abs() <= s_bound).all()
    denom = (exact_s if optimizer == "adagrad" else exact_s[:, None]).sqrt()
    denom_bound = (s_bound if optimizer == "adagrad" else s_bound[:, None]) / (2 * denom)
    step = lr * exact_g / (denom + eps)
    step_bound = lr * g_bound / denom + step.abs() * denom_bound / denom + 4 * u * step.abs()
    exact_w = weights[touched].double() - step
    w_bound = step_bound + u * exact_w.abs()
    assert ((got_w[touched].double() - exact_w).abs() <= w_bound).all()
