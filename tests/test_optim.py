"""Tests for dlrm/optim.py: the dense SGD and Adagrad whose lr is scaled by a device tensor, read without a
host sync."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dlrm.optim import SGD, Adagrad


class AtenOps(TorchDispatchMode):
    """Records the aten ops that run inside it. A device value read by the host (`.item()`, a tensor
    passed where a Python number is expected) shows up as aten._local_scalar_dense: a host sync on CUDA,
    and an error inside a CUDA graph capture."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    @property
    def host_reads(self) -> list[str]:
        return [op for op in self.ops if "_local_scalar_dense" in op]


def _params(seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Dense parameters with gradients (shapes with 1 and primes) and a table with a sparse gradient."""
    g = torch.Generator().manual_seed(seed)
    dense = [torch.randn(shape, generator=g).requires_grad_() for shape in ((1,), (3, 7), (127, 5))]
    for p in dense:
        p.grad = torch.randn(p.shape, generator=g)
    table = torch.randn(11, 4, generator=g).requires_grad_()
    rows = torch.tensor([[0, 3, 3, 10]])
    table.grad = torch.sparse_coo_tensor(rows, torch.randn(4, 4, generator=g), (11, 4))
    return dense, table


def _groups(dense, table, weight_decay: float) -> list[dict]:
    return [
        {"params": dense, "lr": 0.1, "weight_decay": weight_decay},
        {"params": [table], "lr": 0.03, "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_scale_one_is_torch_sgd_exactly(weight_decay):
    ours, theirs = _params(), _params()
    SGD(_groups(*ours, weight_decay), lr=0.1).step()
    torch.optim.SGD(_groups(*theirs, weight_decay), lr=0.1).step()
    for a, b in zip([*ours[0], ours[1]], [*theirs[0], theirs[1]], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_the_step_reads_lr_scale_in_place(weight_decay):
    """One optimizer, its lr_scale written in place between steps: 0 leaves every weight as it was,
    0.25 moves them a quarter of what 1 does (dense and sparse)."""
    dense, table = _params()
    optimizer = SGD(_groups(dense, table, weight_decay), lr=0.1)
    start = [p.detach().clone() for p in (*dense, table)]
    deltas = {}
    for scale in (0.0, 0.25, 1.0):
        with torch.no_grad():
            for p, s in zip((*dense, table), start, strict=True):
                p.copy_(s)
        optimizer.lr_scale.fill_(scale)
        before = [p.detach().clone() for p in (*dense, table)]
        optimizer.step()
        deltas[scale] = [p.detach() - b for p, b in zip((*dense, table), before, strict=True)]
    for d0, d25, d1 in zip(deltas[0.0], deltas[0.25], deltas[1.0], strict=True):
        assert torch.equal(d0, torch.zeros_like(d0))
        assert d1.abs().max() > 0
        torch.testing.assert_close(d25, 0.25 * d1, rtol=1e-5, atol=1e-7)


def test_no_host_read_in_the_step():
    """The step never reads a device value on the host; torch.optim.SGD given a Tensor lr does (its
    foreach path passes the lr as `alpha`), which is why dlrm.optim.SGD exists."""
    dense, table = _params()
    optimizer = SGD([{"params": dense, "lr": 0.1, "weight_decay": 0.01}], lr=0.1)
    optimizer.lr_scale.fill_(0.5)
    with AtenOps() as ours:
        optimizer.step()
    assert "aten._foreach_mul.Tensor" in ours.ops and not ours.host_reads
    torch_sgd = torch.optim.SGD(dense, lr=torch.tensor(0.05))
    with AtenOps() as theirs:
        torch_sgd.step()
    assert theirs.host_reads  # the detector sees the sync this module avoids


def test_bad_arguments():
    with pytest.raises(ValueError, match="lr must be > 0"):
        SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    with pytest.raises(ValueError, match="weight_decay must be >= 0"):
        SGD([torch.zeros(1, requires_grad=True)], lr=0.1, weight_decay=-1.0)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("initial", [0.0, 0.1])
def test_adagrad_at_scale_one_is_torch_adagrad(weight_decay, initial):
    """Three steps of fresh gradients (dense and sparse, a row hit twice): the weights and accumulators of
    torch.optim.Adagrad (lr_decay 0), to fp32 rounding: ours divides then scales where torch's addcdiv
    fuses the two, so results may differ in the last bit of a step."""
    ours, theirs = _params(), _params()
    kwargs = {"lr": 0.1, "eps": 1e-8, "initial_accumulator_value": initial}
    a = Adagrad(_groups(*ours, weight_decay), **kwargs)
    b = torch.optim.Adagrad(_groups(*theirs, weight_decay), **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        a.step()
        b.step()
        for x, y in zip([*ours[0], ours[1]], [*theirs[0], theirs[1]], strict=True):
            fresh = torch.randn(x.shape, generator=g)
            x.grad = fresh.to_sparse() if x.grad.is_sparse else fresh
            y.grad = x.grad.clone()
    for x, y in zip([*ours[0], ours[1]], [*theirs[0], theirs[1]], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(a.state[x]["sum"], b.state[y]["sum"], rtol=1e-6, atol=0)
        assert not torch.equal(a.state[x]["sum"], torch.full_like(x, initial))


def test_adagrad_reads_lr_scale_without_a_host_read():
    """Scale 0 leaves the weights (the accumulators still grow, as the gradients arrived); 0.25 moves them a
    quarter of what 1 does from the same state; no device value is read on the host for dense gradients."""
    dense, _ = _params()
    start = [p.detach().clone() for p in dense]
    deltas = {}
    for scale in (0.0, 0.25, 1.0):
        with torch.no_grad():
            for p, s in zip(dense, start, strict=True):
                p.copy_(s)
        optimizer = Adagrad([{"params": dense, "lr": 0.1, "weight_decay": 0.01}], lr=0.1)
        optimizer.lr_scale.fill_(scale)
        with AtenOps() as ops:
            optimizer.step()
        assert not ops.host_reads
        deltas[scale] = [p.detach() - s for p, s in zip(dense, start, strict=True)]
        assert all(optimizer.state[p]["sum"].abs().max() > 0 for p in dense)
    for d0, d25, d1 in zip(deltas[0.0], deltas[0.25], deltas[1.0], strict=True):
        assert torch.equal(d0, torch.zeros_like(d0)) and d1.abs().max() > 0
        torch.testing.assert_close(d25, 0.25 * d1, rtol=1e-5, atol=1e-7)


def test_adagrad_bad_arguments():
    with pytest.raises(ValueError, match="lr must be > 0"):
        Adagrad([torch.zeros(1, requires_grad=True)], lr=0.0)
    with pytest.raises(ValueError, match="initial_accumulator_value must be >= 0"):
        Adagrad([torch.zeros(1, requires_grad=True)], lr=0.1, initial_accumulator_value=-1.0)


@pytest.mark.parametrize("use_triton", [False, True], ids=["eager", "triton"])
def test_train_adagrad_eps_reaches_both_updates(use_triton):
    """`train.adagrad_eps` is the eps of the dense Adagrad and of the tables' update (torch optimizer group
    or the embedding kernel's fused update)."""
    from dlrm.config import RunConfig, replace
    from dlrm.data.schema import NUM_SPARSE
    from dlrm.model import DLRM
    from dlrm.step import make_optimizer

    cfg = replace(RunConfig(), "train", optimizer="adagrad", adagrad_eps=1e-8, use_triton=use_triton)
    model = DLRM(cfg.model, table_rows=[5] * NUM_SPARSE, sparse_kernel=cfg.sparse_kernel)
    optimizer = make_optimizer(model, cfg)
    assert all(group["eps"] == 1e-8 for group in optimizer.param_groups)
    if use_triton:
        assert model.sparse_arch.optimizer == ("adagrad", 1e-8)
    else:
        assert len(optimizer.param_groups) == 2  # the tables' group
