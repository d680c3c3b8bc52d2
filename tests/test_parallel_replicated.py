"""The replicated (data-parallel) tables of a many-rank run (dlrm.parallel.sharded): their dense gradient is
each row's summed gradient, summed in a fixed order (no atomic adds) wherever the shards' own update is, so
that two runs of one seed on many GPUs get the same bits; by atomic adds where the shards' update adds so
too (SGD on fp32 tables)."""

import pytest
import torch

import kernels.embedding_update
from dlrm.parallel.planner import plan_tables
from dlrm.parallel.sharded import ReplicatedLookup, ShardedSparseArch
from dlrm.parallel.sharded_bags import ReplicatedBagLookup

D = 8
TABLE_ROWS = [7, 3, 40, 1, 12]  # small tables, as the planner replicates them (a 1-row one too)
BAG_SIZES = [2, 1, 3, 1, 4]


def _lookups(device: str, b: int = 50, bag_sizes=BAG_SIZES, d: int = D, seed: int = 0):
    """(weights [R, D], offsets, table rows, bag sizes, rows [b, L] within each table, grad [b, n, D])."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(sum(TABLE_ROWS), d, generator=generator)
    rows = torch.stack(
        [
            torch.randint(0, TABLE_ROWS[f], (b,), generator=generator)
            for f, k in enumerate(bag_sizes)
            for _ in range(k)
        ],
        dim=1,
    )
    grad = torch.randn(b, len(TABLE_ROWS), d, generator=generator)
    as_tensor = lambda values: torch.tensor(values, device=device)  # noqa: E731
    offsets = as_tensor([0, *TABLE_ROWS[:-1]]).cumsum(0)
    return (
        weights.to(device),
        offsets,
        as_tensor(TABLE_ROWS),
        as_tensor(list(bag_sizes)),
        rows.to(device),
        grad.to(device),
    )


def _expected(offsets, bag_sizes, rows, grad, pooling: str) -> torch.Tensor:
    """Each row's summed gradient, in float64 (lookup after lookup)."""
    features = torch.arange(len(bag_sizes)).repeat_interleave(bag_sizes.cpu())
    scale = 1.0 / bag_sizes.cpu()[features].double() if pooling == "mean" else torch.ones(len(features))
    per_lookup = grad.cpu().double()[:, features] * scale[:, None]
    index = rows.cpu() + offsets.cpu()[features]
    out = torch.zeros(sum(TABLE_ROWS), grad.shape[2], dtype=torch.float64)
    return out.index_add_(0, index.reshape(-1), per_lookup.reshape(-1, grad.shape[2]))


def _bag_gradient(
    weights, offsets, table_rows, bag_sizes, rows, grad, pooling: str, in_order: bool = True
) -> torch.Tensor:
    weights = weights.clone().requires_grad_()
    ReplicatedBagLookup.apply(weights, offsets, table_rows, bag_sizes, rows, pooling, in_order).backward(grad)
    return weights.grad


def _one_hot_gradient(weights, offsets, table_rows, rows, grad, in_order: bool = True) -> torch.Tensor:
    weights = weights.clone().requires_grad_()
    ReplicatedLookup.apply(weights, offsets, table_rows, rows, in_order).backward(grad)
    return weights.grad


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_replicated_gradient_is_each_rows_summed_gradient(pooling, in_order):
    """Bags ("sum", "mean") and one id a table, summed in order or by atomic adds: the dense gradient
    [R, D] fp32 sums every lookup's share of its bag's gradient into its row (rows no lookup touched:
    zeros)."""
    weights, offsets, table_rows, bag_sizes, rows, grad = _lookups("cpu")
    got = _bag_gradient(weights, offsets, table_rows, bag_sizes, rows, grad, pooling, in_order)
    assert got.dtype == torch.float32 and got.shape == weights.shape
    torch.testing.assert_close(got, _expected(offsets, bag_sizes, rows, grad, pooling).float())
    weights, offsets, table_rows, ones, rows, grad = _lookups("cpu", bag_sizes=[1] * len(TABLE_ROWS))
    got = _one_hot_gradient(weights, offsets, table_rows, rows, grad, in_order)
    torch.testing.assert_close(got, _expected(offsets, ones, rows, grad, "sum").float())


@pytest.mark.parametrize(
    ("optimizer", "table_dtype", "in_order"),
    [
        ("sgd", "fp32", False),
        ("sgd", "bf16", True),
        ("adagrad", "fp32", True),
        ("rowwise_adagrad", "bf16", True),
    ],
)
def test_replicated_gradient_sums_in_order_where_the_shards_update_does(optimizer, table_dtype, in_order):
    """A sharded arch's replicated tables sum their gradient in order exactly where its shards' own update
    does: every optimizer and table dtype but SGD on fp32 tables, which adds by atomics; before
    configure_optimizer, in order."""
    plan = plan_tables([5] * 26, 4, optimizer, 1)
    arch = ShardedSparseArch(plan, 0, 4, kernel="triton", table_dtype=table_dtype)
    assert arch.replicated_in_order()
    arch.configure_optimizer(optimizer, 0.1)
    assert arch.replicated_in_order() is in_order


def test_replicated_gradient_adds_no_atomics(monkeypatch):
    """The replicated tables' gradient is not the SGD update kernel's (lr -1 into zeros): its atomic adds
    sum a row's lookups in whatever order a GPU's threads come, so the gradient's last bits, and from there
    a whole many-GPU run, differed from run to run (2 H200s, dlrm_dcnv2: val AUC 0.81 and 0.76 at step
    15 of two runs of one seed). Here the kernel is made to refuse to run."""

    class Refused:
        def __getitem__(self, grid):
            raise AssertionError("the replicated tables' gradient went through atomic adds")

    monkeypatch.setattr(kernels.embedding_update, "_sgd_kernel", Refused())
    weights, offsets, table_rows, bag_sizes, rows, grad = _lookups("cpu")
    _bag_gradient(weights, offsets, table_rows, bag_sizes, rows, grad, "sum")
    weights, offsets, table_rows, _, rows, grad = _lookups("cpu", bag_sizes=[1] * len(TABLE_ROWS))
    _one_hot_gradient(weights, offsets, table_rows, rows, grad)


def test_replicated_gradient_out_of_order_adds_by_atomics(monkeypatch):
    """`in_order` False: the SGD update kernel's atomic adds (lr -1 into zeros) sum the gradient, bags and
    one id a table alike, one launch each."""
    launches = []
    atomic = kernels.embedding_update._sgd_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return atomic[grid]

    monkeypatch.setattr(kernels.embedding_update, "_sgd_kernel", Counted())
    weights, offsets, table_rows, bag_sizes, rows, grad = _lookups("cpu")
    _bag_gradient(weights, offsets, table_rows, bag_sizes, rows, grad, "sum", in_order=False)
    weights, offsets, table_rows, _, rows, grad = _lookups("cpu", bag_sizes=[1] * len(TABLE_ROWS))
    _one_hot_gradient(weights, offsets, table_rows, rows, grad, in_order=False)
    assert len(launches) == 2


def _assert_within_sum_bound(got, offsets, bag_sizes, rows, grad, pooling: str) -> None:
    """Each row's gradient `got` [R, D] as accurate as an fp32 sum of its n lookups' shares in any order:
    within k u sum |x_i| of the exact sum, u = 2**-24, k the roundings: n - 1 additions (Higham, Accuracy
    and Stability of Numerical Algorithms, 2nd ed., (4.4)) and, for "mean", each share's after its scale."""
    count = _expected(offsets, bag_sizes, rows, torch.ones_like(grad), "sum")
    roundings = (count - 1).clamp(min=0) + (count if pooling == "mean" else 0)
    magnitude = _expected(offsets, bag_sizes, rows, grad.abs(), pooling)
    bound = roundings * 2.0**-24 * magnitude
    error = (got.cpu().double() - _expected(offsets, bag_sizes, rows, grad, pooling)).abs()
    assert (error <= bound + 1e-12).all()


@pytest.mark.gpu
def test_replicated_gradient_same_bits_every_run_and_in_a_cuda_graph():
    """On a GPU, at a batch where thousands of lookups share a row (b = 32,768, dlrm_dcnv2's tables of
    1 to 40 rows, D = 128): the same bits on every call, and a CUDA-graph capture of the backward (the
    many-GPU step's graph) replays them."""
    weights, offsets, table_rows, bag_sizes, rows, grad = _lookups("cuda", b=32_768, d=128, seed=1)
    for pooling in ("sum", "mean"):
        first = _bag_gradient(weights, offsets, table_rows, bag_sizes, rows, grad, pooling)
        for _ in range(4):
            assert torch.equal(
                _bag_gradient(weights, offsets, table_rows, bag_sizes, rows, grad, pooling), first
            )
        _assert_within_sum_bound(first, offsets, bag_sizes, rows, grad, pooling)
    weights1, offsets1, table_rows1, ones, rows1, grad1 = _lookups(
        "cuda", b=32_768, bag_sizes=[1] * len(TABLE_ROWS), d=128, seed=2
    )
    first = _one_hot_gradient(weights1, offsets1, table_rows1, rows1, grad1)
    for _ in range(4):
        assert torch.equal(_one_hot_gradient(weights1, offsets1, table_rows1, rows1, grad1), first)
    for in_order in (True, False):
        got = _one_hot_gradient(weights1, offsets1, table_rows1, rows1, grad1, in_order)
        _assert_within_sum_bound(got, offsets1, ones, rows1, grad1, "sum")

    def backward():
        return _bag_gradient(weights, offsets, table_rows, bag_sizes, rows, grad, "sum")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = backward()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, backward())
