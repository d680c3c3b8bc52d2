"""Tests for dlrm/optim.py: the dense SGD and Adagrad whose lr is scaled by a device tensor, read without a
host sync."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dlrm import optim
from dlrm.data.schema import NUM_SPARSE
from dlrm.optim import SGD, Adagrad, RunOptimizer
from kernels.adagrad import adagrad_step


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
    assert "aten._fused_sgd_.tensor_lr" in ours.ops and not ours.host_reads
    torch_sgd = torch.optim.SGD(dense, lr=torch.tensor(0.05))
    with AtenOps() as theirs:
        torch_sgd.step()
    assert theirs.host_reads  # the detector sees the sync this module avoids


def test_bad_arguments():
    with pytest.raises(ValueError, match="lr must be > 0"):
        SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    with pytest.raises(ValueError, match="weight_decay must be >= 0"):
        SGD([torch.zeros(1, requires_grad=True)], lr=0.1, weight_decay=-1.0)
    with pytest.raises(ValueError, match='kernel must be "torch" or "triton", got \'cuda\''):
        SGD([torch.zeros(1, requires_grad=True)], lr=0.1, kernel="cuda")


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_sgd_triton_kernel_is_the_fused_step(monkeypatch, weight_decay):
    """Kernel "triton": the dense group steps in kernels/multi_tensor.py's one launch (the sparse table by
    its own step); three steps at lr_scale 0.5 end at kernel "torch"'s weights to fp32 rounding (the same
    product and difference; a multiply-add may fuse on one side only), with no device value read on the
    host."""
    launches = []
    real = optim.sgd_step_together
    monkeypatch.setattr(
        optim, "sgd_step_together", lambda p, *args: launches.append(len(p)) or real(p, *args)
    )
    ours, theirs = _params(), _params()
    a = SGD(_groups(*ours, weight_decay), lr=0.1, kernel="triton")
    b = SGD(_groups(*theirs, weight_decay), lr=0.1)
    a.lr_scale.fill_(0.5)
    b.lr_scale.fill_(0.5)
    for _ in range(3):
        with AtenOps() as ops:
            a.step()
        assert not ops.host_reads
        b.step()
    assert launches == [3] * 3
    for x, y in zip([*ours[0], ours[1]], [*theirs[0], theirs[1]], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_sgd_triton_kernel_leaves_what_it_cannot_take_to_torchs_step(monkeypatch):
    """A group the one launch cannot take (a transposed view as a parameter) steps by torch._fused_sgd_,
    as kernel "torch" would."""
    monkeypatch.setattr(optim, "sgd_step_together", lambda *args: pytest.fail("launched"))
    base = torch.randn(5, 7)
    ours, theirs = base.clone().t().requires_grad_(), base.clone().t().requires_grad_()
    ours.grad = torch.randn(7, 5)
    theirs.grad = ours.grad.clone()
    SGD([ours], lr=0.1, kernel="triton").step()
    SGD([theirs], lr=0.1).step()
    assert torch.equal(ours, theirs)


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


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adagrad_triton_kernel_is_the_foreach_step(monkeypatch, weight_decay):
    """Kernel "triton": the tensors of at least ADAGRAD_KERNEL_MIN_ELEMENTS (lowered here to 30: the
    [127, 5] one) step in kernels/adagrad.py, the rest by the foreach ops; three steps at lr_scale 0.5 end
    at the weights and accumulators of kernel "torch" to fp32 rounding (the same operations in the same
    order, IEEE square root and division; a multiply-add may fuse on one side only), with no device value
    read on the host."""
    monkeypatch.setattr(optim, "ADAGRAD_KERNEL_MIN_ELEMENTS", 30)
    stepped = []

    def counted(p, *args):
        stepped.append(p.numel())
        adagrad_step(p, *args)

    monkeypatch.setattr(optim, "adagrad_step", counted)
    ours, theirs = _params()[0], _params()[0]
    a = Adagrad([{"params": ours, "weight_decay": weight_decay}], lr=0.1, eps=1e-8, kernel="triton")
    b = Adagrad([{"params": theirs, "weight_decay": weight_decay}], lr=0.1, eps=1e-8)
    a.lr_scale.fill_(0.5)
    b.lr_scale.fill_(0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        with AtenOps() as ops:
            a.step()
        assert not ops.host_reads
        b.step()
        for x, y in zip(ours, theirs, strict=True):
            x.grad = torch.randn(x.shape, generator=g)
            y.grad = x.grad.clone()
    assert stepped == [635] * 3
    for x, y in zip(ours, theirs, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(a.state[x]["sum"], b.state[y]["sum"], rtol=1e-6, atol=0)


def test_adagrad_kernel_refuses_mismatched_tensors():
    p, scale = torch.zeros(4, 3), torch.ones(())
    with pytest.raises(ValueError, match=r"contiguous fp32 .* got gradient torch.float32 \[3, 4\]"):
        adagrad_step(p, torch.zeros(3, 4), torch.zeros(4, 3), 0.1, scale, 1e-8)
    with pytest.raises(ValueError, match=r"got accumulator torch.float64"):
        adagrad_step(p, torch.zeros(4, 3), torch.zeros(4, 3, dtype=torch.float64), 0.1, scale, 1e-8)
    with pytest.raises(ValueError, match=r"got scale torch.float32 \[2\]"):
        adagrad_step(p, torch.zeros(4, 3), torch.zeros(4, 3), 0.1, torch.ones(2), 1e-8)


def test_adagrad_triton_kernel_leaves_what_it_cannot_take_to_the_foreach_step(monkeypatch):
    """A tensor above the size floor that the kernel cannot take (a transposed view as the parameter, its
    gradient and accumulator contiguous) steps by the foreach ops, as kernel "torch" would."""
    monkeypatch.setattr(optim, "ADAGRAD_KERNEL_MIN_ELEMENTS", 1)
    stepped = []
    monkeypatch.setattr(optim, "adagrad_step", lambda p, *args: stepped.append(p.numel()))
    base = torch.randn(5, 7)
    ours = base.clone().t().requires_grad_()
    theirs = base.clone().t().requires_grad_()
    a = Adagrad([ours], lr=0.1, kernel="triton")
    b = Adagrad([theirs], lr=0.1)
    ours.grad = torch.randn(7, 5)
    assert not ours.is_contiguous() and ours.grad.is_contiguous()
    theirs.grad = ours.grad.clone()
    a.step()
    b.step()
    assert stepped == []
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_adagrad_bad_arguments():
    with pytest.raises(ValueError, match="lr must be > 0"):
        Adagrad([torch.zeros(1, requires_grad=True)], lr=0.0)
    with pytest.raises(ValueError, match='kernel must be "torch" or "triton", got \'cuda\''):
        Adagrad([torch.zeros(1, requires_grad=True)], lr=0.1, kernel="cuda")
    with pytest.raises(ValueError, match="initial_accumulator_value must be >= 0"):
        Adagrad([torch.zeros(1, requires_grad=True)], lr=0.1, initial_accumulator_value=-1.0)


def _rowwise_reference(table, sums, updates, lr, eps):
    """Row-wise Adagrad written out row by row: for each touched row r with summed gradient g [D],
    s_r += sum(g^2) / D, then w_r -= lr * g / (sqrt(s_r) + eps)."""
    for r, g in updates.items():
        sums[r] += sum(float(v) ** 2 for v in g) / len(g)
        table[r] -= lr * g / (math.sqrt(sums[r]) + eps)


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse-grad", "dense-grad"])
def test_rowwise_adagrad_is_the_row_by_row_reference(sparse):
    """Three steps of fresh gradients on a [11, 4] table (rows hit twice in a step, rows never hit): the
    weights and the [11] accumulators of the written-out update. The sums differ only in fp32 order."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(11, 4, generator=g).requires_grad_()
    expected, sums = table.detach().double().clone(), [0.1] * 11
    lr, eps = 0.05, 1e-3
    optimizer = Adagrad([{"params": [table], "rowwise": True}], lr=lr, eps=eps, initial_accumulator_value=0.1)
    optimizer.lr_scale.fill_(0.5)
    for step in range(3):
        rows = torch.tensor([0, 3, 3, 10, step])  # row 3 twice; rows 1, 5.. never
        values = torch.randn(5, 4, generator=g)
        grad = torch.sparse_coo_tensor(rows[None], values, (11, 4))
        table.grad = grad if sparse else grad.to_dense()
        optimizer.step()
        updates = {}
        for r, v in zip(rows.tolist(), values.double(), strict=True):
            updates[r] = updates.get(r, 0) + v
        _rowwise_reference(expected, sums, updates, lr * 0.5, eps)
    assert optimizer.state[table]["sum"].shape == (11,)
    torch.testing.assert_close(
        optimizer.state[table]["sum"].double(), torch.tensor(sums, dtype=torch.float64), rtol=1e-6, atol=0
    )
    torch.testing.assert_close(table.detach().double(), expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(table.detach()[1], expected[1].float())  # never touched: unchanged


def test_rowwise_adagrad_takes_tables_only():
    with pytest.raises(ValueError, match=r"rowwise group takes \[rows, D\] tables, got \[3\]"):
        Adagrad([{"params": [torch.zeros(3, requires_grad=True)], "rowwise": True}], lr=0.1)


def test_rowwise_adagrad_agrees_with_the_triton_tables():
    """The "triton" tables (kernels/embedding.py's fused update, the interpreter on a CPU) and the "torch"
    tables with RunOptimizer's row-wise group: same start, same ids and upstream gradients, three steps:
    the same weights and per-row accumulators, to fp32 summation order."""
    from dlrm.model.dlrm import SparseArch

    rows, dim, lr = [7] * NUM_SPARSE, 4, 0.05
    torch.manual_seed(0)
    triton = SparseArch(dim, rows, kernel="triton")
    torch.manual_seed(0)
    eager = SparseArch(dim, rows, kernel="torch")
    triton.configure_optimizer("rowwise_adagrad", lr)
    optimizer = Adagrad([{"params": list(eager.parameters()), "rowwise": True}], lr=lr)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(-1, 20, (5, NUM_SPARSE), generator=g)  # repeats and missing (-1) ids
        upstream = torch.randn(5, NUM_SPARSE, dim, generator=g)
        (triton(ids) * upstream).sum().backward()
        (eager(ids) * upstream).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    sums = torch.cat([optimizer.state[table.weight]["sum"] for table in eager.embeddings])
    assert sums.shape == triton.optimizer_state.shape == (sum(rows),) and sums.abs().sum() > 0
    torch.testing.assert_close(triton.optimizer_state, sums, rtol=1e-6, atol=1e-9)
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(triton.state_dict()[key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_rowwise_adagrad_reaches_both_table_kernels():
    """RunOptimizer with train.optimizer "rowwise_adagrad": the "triton" tables (the DLRM's and the
    first-order ones) get the kernel's row-wise update with [rows] state; the "torch" tables a row-wise
    group; the MLPs plain Adagrad."""
    from dlrm.config import RunConfig, replace
    from dlrm.model import make_model

    cfg = replace(replace(RunConfig(), "model", first_order=True), "train", optimizer="rowwise_adagrad")
    rows = [5] * NUM_SPARSE
    triton = make_model(cfg.model, table_rows=rows, sparse_kernel="triton")
    optimizer = RunOptimizer(triton, cfg.train)
    for tables in triton.table_archs():
        assert tables.optimizer[0] == "rowwise_adagrad" and tables.optimizer_state.shape == (sum(rows),)
    assert [g["rowwise"] for g in optimizer.param_groups] == [False]
    eager = make_model(cfg.model, table_rows=rows)
    optimizer = RunOptimizer(eager, cfg.train)
    assert [g["rowwise"] for g in optimizer.param_groups] == [False, True]
    tables = optimizer.param_groups[1]["params"]
    assert len(tables) == 2 * NUM_SPARSE and all(optimizer.state[p]["sum"].shape == (5,) for p in tables)


def test_rowwise_adagrad_trains_and_resumes(criteo_sample, tmp_path):
    """tiny.json with --set train.optimizer=rowwise_adagrad through the CLI: the checkpoint holds one
    accumulator per table row, and a run resumes from it."""
    from click.testing import CliRunner

    from dlrm import train as train_cli
    from tests.test_train import TINY, _losses

    def run(*flags):
        args = ["--config", str(TINY), "--set", f"data.path={criteo_sample}", "--set", "train.log_interval=1",
                "--set", "train.optimizer=rowwise_adagrad", "--set", "profiler.enabled=false",
                "--device", "cpu", "--output-dir", str(tmp_path / "run"), *flags]  # fmt: skip
        result = CliRunner().invoke(train_cli.main, args)
        assert result.exit_code == 0, result.output
        return _losses(tmp_path / "run")

    assert len(run("--max-steps", "3")) == 3
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    optimizer = torch.load(last, weights_only=True)["optimizer"]
    tables = optimizer["param_groups"][1]
    assert tables["rowwise"] and len(tables["params"]) == NUM_SPARSE
    sums = [optimizer["state"][i]["sum"] for i in tables["params"]]
    assert all(s.dim() == 1 for s in sums) and sum(s.abs().sum() for s in sums) > 0
    assert len(run("--max-steps", "5", "--resume", str(last))) == 5


@pytest.mark.parametrize("use_triton", [False, True], ids=["eager", "triton"])
def test_train_adagrad_eps_reaches_both_updates(use_triton):
    """`train.adagrad_eps` is the eps of the dense Adagrad and of the tables' update (torch optimizer group
    or the embedding kernel's fused update)."""
    from dlrm.config import RunConfig, replace
    from dlrm.data.schema import NUM_SPARSE
    from dlrm.model import DLRM

    cfg = replace(RunConfig(), "train", optimizer="adagrad", adagrad_eps=1e-8, use_triton=use_triton)
    model = DLRM(cfg.model, table_rows=[5] * NUM_SPARSE, sparse_kernel=cfg.sparse_kernel)
    optimizer = RunOptimizer(model, cfg.train)
    assert all(group["eps"] == 1e-8 for group in optimizer.param_groups)
    if use_triton:
        assert model.sparse_arch.optimizer == ("adagrad", 1e-8)
    else:
        assert len(optimizer.param_groups) == 2  # the tables' group


def _run_optimizer(optimizer: str = "adagrad", kernel: str = "triton", seed: int = 0):
    """A small DLRM with first-order tables (two table sets) and its RunOptimizer."""
    from dlrm.config import ModelConfig, TrainConfig
    from dlrm.model import make_model

    model_cfg = ModelConfig(embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1), first_order=True)
    torch.manual_seed(seed)
    model = make_model(model_cfg, table_rows=[5] * NUM_SPARSE, sparse_kernel=kernel)
    train = TrainConfig(optimizer=optimizer, lr=0.1, embedding_lr=0.04)
    return model, RunOptimizer(model, train)


def test_run_optimizer_owns_one_embedding_lr_that_set_scale_writes():
    """Every "triton" table set reads the optimizer's one `embedding_lr` tensor; set_scale writes it and
    the dense `lr_scale` from the base rates."""
    model, optimizer = _run_optimizer()
    assert len(model.table_archs()) == 2
    assert all(arch.lr is optimizer.embedding_lr for arch in model.table_archs())
    assert all(arch.optimizer == ("adagrad", 1e-10) for arch in model.table_archs())
    assert optimizer.embedding_lr.item() == pytest.approx(0.04)
    optimizer.set_scale(0.25)
    assert (optimizer.lr_scale.item(), optimizer.embedding_lr.item()) == pytest.approx((0.25, 0.01))
    assert optimizer.lr == pytest.approx(0.025)
    assert [group["lr"] for group in optimizer.param_groups] == [0.1]  # base rates, as checkpoints save


@pytest.mark.parametrize("kernel", ["triton", "torch"])
def test_run_optimizer_state_dict_round_trips_dense_and_table_states(kernel):
    """state_dict holds the dense optimizer's state and each table set's fused state under the checkpoint's
    keys; load_state_dict into a fresh model's optimizer restores both."""
    model, optimizer = _run_optimizer(kernel=kernel)
    g = torch.Generator().manual_seed(3)
    for state in optimizer.state.values():
        state["sum"].copy_(torch.rand(state["sum"].shape, generator=g))
    for arch in optimizer.fused_tables:
        arch.optimizer_state.copy_(torch.rand(arch.optimizer_state.shape, generator=g))
    saved = optimizer.state_dict()
    assert set(saved) == {
        "optimizer", "embedding_optimizer_state", "first_order_optimizer_state", "table_rounding_count"
    }  # fmt: skip
    if kernel == "torch":
        assert saved["embedding_optimizer_state"] is None and saved["first_order_optimizer_state"] is None
    _, fresh = _run_optimizer(kernel=kernel, seed=1)
    fresh.load_state_dict({key: v.clone() if torch.is_tensor(v) else v for key, v in saved.items()})
    for ours, theirs in zip(fresh.state.values(), optimizer.state.values(), strict=True):
        assert torch.equal(ours["sum"], theirs["sum"])
    for ours, theirs in zip(fresh.fused_tables, optimizer.fused_tables, strict=True):
        assert ours.optimizer_state.abs().sum() > 0
        assert torch.equal(ours.optimizer_state, theirs.optimizer_state)
    assert len(fresh.fused_tables) == (2 if kernel == "triton" else 0)


def test_run_optimizer_loads_table_states_without_a_dense_state_dict():
    """A sharded checkpoint read whole has "optimizer" None (its dense state loads by name): the table
    states still load, and the dense state is left as it was."""
    model, optimizer = _run_optimizer()
    before = [state["sum"].clone() for state in optimizer.state.values()]
    state = torch.rand(optimizer.fused_tables[0].optimizer_state.shape)
    optimizer.load_state_dict({"optimizer": None, "embedding_optimizer_state": state})
    assert torch.equal(model.sparse_arch.optimizer_state, state)
    assert all(torch.equal(s["sum"], b) for s, b in zip(optimizer.state.values(), before, strict=True))
