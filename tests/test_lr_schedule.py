"""Tests for dlrm/lr_schedule.py: MLPerf's warm-up and decay factors, and the rates reaching the step (the one
a CUDA graph captures) through device tensors, without a host sync. CPU: the Triton kernels run in the
interpreter (conftest); the graph replay itself is GPU-only (tests/test_graphs.py)."""

import dataclasses
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dlrm import train as train_cli
from dlrm.config import LrScheduleConfig, ModelConfig, RunConfig, TrainConfig, load_config, replace
from dlrm.data.dataset import Batch
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.lr_schedule import LearningRates, lr_factor
from dlrm.model import DLRM, make_model
from dlrm.optim import RunOptimizer
from dlrm.step import train_step
from kernels import op
from tests.conftest import REPO

W, S, N = 8, 20, 10  # warmup_steps, decay_start_step, decay_steps
MLPERF = LrScheduleConfig(warmup_steps=W, decay_start_step=S, decay_steps=N)


def _mlperf_scale(k: int) -> float | None:
    """MLPerf's LRPolicyScheduler.get_lr (facebookresearch/dlrm, dlrm_s_pytorch.py) at _step_count k, in
    the two branches that compute a scale: warm-up (k < W) and decay (S <= k < S + N). None elsewhere, where
    it repeats its last value (see dlrm/lr_schedule.py for why we do not)."""
    if k < W:
        return 1.0 - (W - k) / W
    if S <= k < S + N:
        return ((N - (k - S)) / N) ** 2
    return None


@pytest.mark.parametrize("k", [1, 2, 5, 7, 20, 21, 24, 29])
def test_warmup_and_decay_match_mlperf(k):
    assert lr_factor(MLPERF, k) == pytest.approx(_mlperf_scale(k), rel=1e-12)


@pytest.mark.parametrize(
    ("k", "expected"),
    [
        (8, 1.0),  # the warm-up's end: the full rate
        (13, 1.0),  # the plateau (MLPerf keeps (W - 1) / W here)
        (19, 1.0),
        (20, 1.0),  # the decay's first step
        (30, 0.0),  # S + N: the decay reaches 0 (MLPerf keeps 1 / N**2 from here on)
        (31, 0.0),
        (10**6, 0.0),
    ],
)
def test_plateau_and_end(k, expected):
    assert lr_factor(MLPERF, k) == expected


def test_defaults_are_constant_and_parts_stand_alone():
    assert all(lr_factor(LrScheduleConfig(), k) == 1.0 for k in (1, 2, 10**9))
    warmup_only = LrScheduleConfig(warmup_steps=4)
    assert [lr_factor(warmup_only, k) for k in range(1, 7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    decay_only = LrScheduleConfig(decay_start_step=1, decay_steps=2)
    assert [lr_factor(decay_only, k) for k in range(1, 5)] == [1.0, 0.25, 0.0, 0.0]
    with pytest.raises(ValueError, match="steps count from 1, got 0"):
        lr_factor(MLPERF, 0)


SMALL = ModelConfig(embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1), max_rows=100)


def _model_and_optimizer(optimizer="sgd", sparse_kernel="triton", schedule=MLPERF, weight_decay=0.01):
    train = TrainConfig(
        optimizer=optimizer, lr=0.1, embedding_lr=0.05, weight_decay=weight_decay, lr_schedule=schedule
    )
    cfg = RunConfig(model=SMALL, train=train)
    torch.manual_seed(0)
    mlp_kernel = "linear_act" if sparse_kernel == "triton" else "torch"
    model = DLRM(SMALL, table_rows=[37] * NUM_SPARSE, mlp_kernel=mlp_kernel, sparse_kernel=sparse_kernel)
    optimizer = RunOptimizer(model, cfg.train)
    return model, optimizer, LearningRates(cfg.train.lr_schedule, optimizer)


@pytest.mark.parametrize("arch", ["dlrm", "logistic"])
def test_every_fused_table_set_follows_the_schedule(arch):
    """The first-order tables (model.first_order, model.arch logistic) have an lr tensor of their own."""
    model_cfg = dataclasses.replace(SMALL, first_order=True) if arch == "dlrm" else ModelConfig(arch=arch)
    cfg = RunConfig(model=model_cfg, train=TrainConfig(lr=0.1, embedding_lr=0.05, lr_schedule=MLPERF))
    model = make_model(model_cfg, table_rows=[37] * NUM_SPARSE, sparse_kernel="triton")
    optimizer = RunOptimizer(model, cfg.train)
    lrs = LearningRates(cfg.train.lr_schedule, optimizer)
    lrs.set(2)
    assert len(model.table_archs()) == (2 if arch == "dlrm" else 1)
    for tables in model.table_archs():
        assert tables.lr.item() == pytest.approx(0.05 * lr_factor(MLPERF, 2))


def _batch(seed: int = 0, b: int = 16) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(
        torch.rand(b, NUM_DENSE, generator=g),
        torch.randint(-1, 1000, (b, NUM_SPARSE), generator=g),
        (torch.rand(b, generator=g) < 0.3).float(),
    )


class AtenCalls(TorchDispatchMode):
    """Records every op dispatched inside it with its arguments: what a CUDA graph capture of the same code
    would record (tensors by address, Python numbers baked in). A device value read on the host shows up as
    aten._local_scalar_dense: a sync on CUDA, an error inside a capture."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, list]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((str(func), tree_leaves((args, kwargs or {}))))
        return func(*args, **(kwargs or {}))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def numbers(self) -> list[float]:
        return [x for _, leaves in self.calls for x in leaves if isinstance(x, float)]

    def takes(self, tensor: torch.Tensor) -> list[str]:
        """The ops that took `tensor` itself (same object) as an argument."""
        return [name for name, leaves in self.calls if any(x is tensor for x in leaves)]


def test_set_writes_the_device_tensors_only_when_the_factor_changes():
    model, optimizer, lrs = _model_and_optimizer()
    scale, embedding_lr = optimizer.lr_scale, model.sparse_arch.lr
    with AtenCalls() as calls:
        for k in range(1, 31):
            lrs.set(k)
            assert (scale.item(), embedding_lr.item()) == pytest.approx(
                (lr_factor(MLPERF, k), 0.05 * lrs.factor)
            )
            assert lrs.lr == pytest.approx(0.1 * lr_factor(MLPERF, k))
    # In place, on the device, no host read: one fill per tensor per change of the factor (.item() above is
    # the test's own read).
    writes = [name for name in calls.names() if name != "aten._local_scalar_dense.default"]
    assert set(writes) == {"aten.fill_.Scalar"} and len(writes) == 2 * (W + N)
    assert optimizer.param_groups[0]["lr"] == 0.1  # the base rate stays what checkpoints save
    _, _, constant = _model_and_optimizer(schedule=LrScheduleConfig())
    versions = (constant.optimizer.lr_scale._version, constant.optimizer.embedding_lr._version)
    for k in range(1, 100):
        constant.set(k)
    assert (constant.optimizer.lr_scale._version, constant.optimizer.embedding_lr._version) == versions


def test_adagrad_and_eager_tables_get_the_scale_and_keep_base_group_rates():
    """dlrm.optim.Adagrad with the eager tables' group: the factor goes to `lr_scale`, which both groups'
    updates read; the groups keep their base rates (what checkpoints save and --resume compares)."""
    model, optimizer, lrs = _model_and_optimizer("adagrad", "torch")
    lrs.set(2)
    assert optimizer.lr_scale.item() == pytest.approx(2 / W)
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([0.1, 0.05])


@pytest.mark.parametrize("through_ops", [False, True], ids=["eager", "custom_ops"])
def test_the_captured_step_reads_the_lr_tensors(monkeypatch, through_ops):
    """What GraphedTrainStep captures (train_step on the "triton" model and dlrm.optim.SGD), recorded op by
    op: the rates enter as the tensors LearningRates writes (the embedding ops and the dense update take
    them), never as Python numbers, and nothing is read back to the host. Eager calls of our kernels skip
    the dispatcher (kernels/op.py); through the custom ops, which get the same arguments, the
    dispatcher records that the embedding ops take the lr tensor itself."""
    if through_ops:
        monkeypatch.setattr(op, "is_compiling", lambda: True)
    model, optimizer, lrs = _model_and_optimizer()
    train_step(model, optimizer, _batch(0))  # first call: Triton JIT, lazy state
    lrs.set(3)  # factor 3/8: dense lr 0.0375, embedding lr 0.01875
    with AtenCalls() as calls:
        train_step(model, optimizer, _batch(1))
    assert "aten._local_scalar_dense.default" not in calls.names()
    for rate in (0.1 * 3 / W, 0.05 * 3 / W, -0.1 * 3 / W, 3 / W):
        assert not any(math.isclose(x, rate, rel_tol=1e-6) for x in calls.numbers()), rate
    if through_ops:
        assert {"dlrm.embedding_lookup.default", "dlrm.embedding_update.default"} <= set(
            calls.takes(model.sparse_arch.lr)
        )
    assert calls.takes(optimizer.lr_scale)  # the dense update multiplies by it


@pytest.mark.parametrize("sparse_kernel", ["triton", "torch"])
def test_the_same_step_follows_the_rates_written_between_calls(sparse_kernel):
    """One model, optimizer and step function (as a captured graph is), the rates written in place between
    calls: factor 0 leaves every weight unchanged; factor 1/2 moves the weights half as far as factor 1
    from the same state (SGD is linear in the lr for a given gradient)."""
    model, optimizer, lrs = _model_and_optimizer(
        sparse_kernel=sparse_kernel,
        schedule=LrScheduleConfig(warmup_steps=2, decay_start_step=2, decay_steps=1),
    )
    train_step(model, optimizer, _batch(0))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    deltas = {}
    for k in (3, 1, 2):  # factors 0, 1/2, 1
        model.load_state_dict(start)
        lrs.set(k)
        train_step(model, optimizer, _batch(1))
        deltas[lrs.factor] = {key: model.state_dict()[key] - value for key, value in start.items()}
    for key, zero in deltas[0.0].items():
        assert torch.equal(zero, torch.zeros_like(zero)), key
        torch.testing.assert_close(deltas[0.5][key], 0.5 * deltas[1.0][key], rtol=1e-4, atol=1e-7, msg=key)
    tables = next(key for key in start if "embeddings" in key)
    top_mlp = next(key for key in start if key.startswith("over_arch") and key.endswith("weight"))
    assert deltas[1.0][tables].abs().max() > 0 and deltas[1.0][top_mlp].abs().max() > 0


def _tiny(data_dir, **train):
    cfg = load_config(REPO / "configs" / "tiny.json")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(data_dir)))
    return replace(cfg, "train", **train)


@pytest.mark.parametrize("use_triton", [False, True])
def test_a_run_follows_the_schedule_and_resumes_exactly(criteo_sample, tmp_path, use_triton):
    """train(): warm-up over 3 steps, decay from step 4 to 0 at step 6. Steps 6 to 8 (factor 0) change
    nothing, so 8 steps give the weights of 5; TensorBoard's train/lr is the schedule's; a run stopped in
    the warm-up (step 3) and resumed gives the weights of the uninterrupted one."""
    schedule = LrScheduleConfig(warmup_steps=3, decay_start_step=4, decay_steps=2)

    def run(name: str, max_steps: int, resume=None) -> dict:
        cfg = _tiny(
            criteo_sample, max_steps=max_steps, log_interval=1, lr_schedule=schedule, use_triton=use_triton
        )
        train_cli.train(cfg, tmp_path / name, resume=resume)
        return torch.load(tmp_path / name / "checkpoints" / "last.pt", weights_only=True)["model"]

    whole, five = run("whole", 8), run("five", 5)
    for key, value in whole.items():
        assert torch.equal(five[key], value), key
    events = EventAccumulator(str(tmp_path / "whole"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/lr")]
    expected = [0.1 / 3, 0.2 / 3, 0.1, 0.1, 0.025, 0.0, 0.0, 0.0]  # steps 1..8
    assert [step for step, _ in logged] == list(range(1, 9))
    assert [value for _, value in logged] == pytest.approx(expected, rel=1e-6)
    if use_triton:
        return  # two more runs in the Triton interpreter cost a minute; the loop's resume path is the same
    run("first_part", 3)
    resumed = run("resumed", 8, resume=tmp_path / "first_part" / "checkpoints" / "last.pt")
    for key, value in whole.items():
        torch.testing.assert_close(resumed[key], value, rtol=1e-6, atol=1e-7, msg=key)
