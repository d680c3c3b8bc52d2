"""Tests of the plain-PyTorch baseline step of scripts/bench_train.py (scripts/torch_graphed_step.py): on the
CPU, uncompiled and uncaptured, its loss and updated weights equal our eager model's SGD step; it and
bench_train's steps of our model run under their precision's flags whatever the caller set, and give the
caller's back; a compiled baseline starts from fresh dynamo state."""

import csv
import functools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from dlrm.config import load_config, replace
from dlrm.data.dataset import Batch
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.device import set_precision
from dlrm.model import DLRM
from dlrm.optim import RunOptimizer
from dlrm.step import train_step
from tests.conftest import load_script

_PATH = Path(__file__).parents[1] / "scripts" / "torch_graphed_step.py"
baseline = load_script("torch_graphed_step")

# Small primes and a 1-row table; the tiny config's widths (D = 8).
TABLE_ROWS = [
    1, 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97,
]  # fmt: skip
# Loss and weights: the same ops in the same dtypes, bit-equal on the CPU where this was written (torch 2.13);
# the room is for the order in which repeated rows' gradients are summed (index_add_ vs a coalesced sparse
# gradient), which another build may change.
TOLERANCE = {"rtol": 1e-6, "atol": 1e-7}


def batch(b: int, generator: torch.Generator) -> Batch:
    """Random batch with ids far beyond the tables (modulus hashing), missing ids (-1) and repeated rows."""
    sparse = torch.randint(-1, 1000, (b, NUM_SPARSE), generator=generator)
    sparse[: b // 2, 3] = 17  # the same row of table 3 for half the batch: gradients must add up
    dense = torch.rand(b, NUM_DENSE, generator=generator) * 3
    label = (torch.rand(b, generator=generator) < 0.3).float()
    return Batch(dense, sparse, label)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_baseline_step_equals_our_eager_sgd_step(precision):
    cfg = load_config(Path(__file__).parents[1] / "configs" / "tiny.json")
    cfg = replace(cfg, "train", precision=precision, lr=0.5, embedding_lr=0.3)
    torch.manual_seed(0)
    ours = DLRM(cfg.model, table_rows=TABLE_ROWS)
    optimizer = RunOptimizer(ours, cfg.train)
    m = cfg.model
    plain = baseline.PlainDLRM(m.embedding_dim, m.bottom_mlp, m.top_mlp, TABLE_ROWS)
    plain.load_dlrm_state_dict(ours.state_dict())
    step = baseline.TorchGraphedStep(
        plain, lr=0.5, embedding_lr=0.3, precision=precision, compile=False, cuda_graph=False
    )
    before = plain.weight.clone()
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):  # later steps start from the updated weights of both
        b = batch(37, generator)
        expected = train_step(ours, optimizer, b, precision=precision)
        loss = step(b)
        torch.testing.assert_close(loss, expected.detach(), **TOLERANCE)
    state = ours.state_dict()
    tables = torch.cat([state[f"sparse_arch.embeddings.{f}.weight"] for f in range(NUM_SPARSE)])
    assert not torch.equal(tables, before)  # the steps moved the tables (so the comparison means something)
    torch.testing.assert_close(plain.weight, tables, **TOLERANCE)
    for prefix, layers in (("dense_arch", plain.bottom), ("over_arch", plain.top)):
        for i, layer in enumerate(layers):
            torch.testing.assert_close(layer.weight, state[f"{prefix}.mlp.layers.{i}.weight"], **TOLERANCE)
            torch.testing.assert_close(layer.bias, state[f"{prefix}.mlp.layers.{i}.bias"], **TOLERANCE)


def test_a_wrong_learning_rate_is_caught():
    """The comparison above can fail: the tables' lr taken for the MLPs moves them differently."""
    cfg = replace(load_config(Path(__file__).parents[1] / "configs" / "tiny.json"), "train", embedding_lr=0.3)
    torch.manual_seed(0)
    ours = DLRM(cfg.model, table_rows=TABLE_ROWS)
    optimizer = RunOptimizer(ours, cfg.train)
    plain = baseline.PlainDLRM(8, cfg.model.bottom_mlp, cfg.model.top_mlp, TABLE_ROWS)
    plain.load_dlrm_state_dict(ours.state_dict())
    step = baseline.TorchGraphedStep(plain, lr=0.3, embedding_lr=0.3, compile=False, cuda_graph=False)
    b = batch(16, torch.Generator().manual_seed(2))
    train_step(ours, optimizer, b)
    step(b)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(plain.top[0].weight, ours.state_dict()["over_arch.mlp.layers.0.weight"])


def test_bad_arguments():
    plain = baseline.PlainDLRM(8, [32, 8], [32, 1], TABLE_ROWS)
    with pytest.raises(ValueError, match="CUDA graph needs the model on a CUDA device"):
        baseline.TorchGraphedStep(plain, lr=0.1, compile=False)
    with pytest.raises(ValueError, match="unknown precision"):
        baseline.TorchGraphedStep(plain, lr=0.1, precision="fp16", cuda_graph=False)
    with pytest.raises(ValueError, match="bottom MLP ending in D=8"):
        baseline.PlainDLRM(8, [32, 16], [32, 1], TABLE_ROWS)


def test_bench_train_refuses_configs_the_baseline_does_not_cover(monkeypatch):
    """bench_train.py's "torch-graphed" backend checks the config before touching the GPU."""
    import click

    from dlrm import parallel

    monkeypatch.syspath_prepend(str(_PATH.parent))
    import bench_train

    cfg = load_config(Path(__file__).parents[1] / "configs" / "main_attention.json")
    with pytest.raises(click.UsageError, match="model.interaction='attention'"):
        bench_train.build_baseline(cfg, TABLE_ROWS, parallel.SINGLE)
    cfg = replace(
        load_config(Path(__file__).parents[1] / "configs" / "kaggle.json"), "train", optimizer="adagrad"
    )
    with pytest.raises(click.UsageError, match="train.optimizer='adagrad'"):
        bench_train.build_baseline(cfg, TABLE_ROWS, parallel.SINGLE)


def test_bench_train_table_rows_of_a_preset_or_of_the_config(monkeypatch):
    """`--cardinalities config` benchmarks the config's own tables (dlrm_dcnv2: MLPerf's 204M rows, not the
    1TB preset's 178M); a config without model.table_rows is refused by name."""
    import click

    monkeypatch.syspath_prepend(str(_PATH.parent))
    import bench_train

    configs = Path(__file__).parents[1] / "configs"
    dcn = load_config(configs / "dlrm_dcnv2.json")
    assert bench_train.preset_rows(dcn, "config") == tuple(dcn.model.table_rows)
    assert sum(bench_train.preset_rows(dcn, "config")) > sum(bench_train.preset_rows(dcn, "terabyte"))
    kaggle = load_config(configs / "kaggle.json")
    assert len(bench_train.preset_rows(kaggle, "kaggle")) == NUM_SPARSE
    with pytest.raises(click.UsageError, match="config 'kaggle' sets no model.table_rows"):
        bench_train.preset_rows(kaggle, "config")


# The flags a step of each precision must see: TF32 matmuls (cuBLAS allow_tf32, the float32 matmul precision,
# cuDNN allow_tf32) for "tf32" only.
REQUIRED = {
    "fp32": (False, False, "highest"),
    "tf32": (True, True, "high"),
    "bf16": (False, False, "highest"),
}


def legacy_flags() -> tuple[bool, bool, str] | None:
    """(cuBLAS allow_tf32, cuDNN allow_tf32, float32 matmul precision); None where torch refuses to read
    them (after the fp32_precision properties were set)."""
    try:
        return (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.get_float32_matmul_precision(),
        )
    except RuntimeError:
        return None


def fp32_precisions() -> tuple[str, ...]:
    """The fp32_precision properties (always readable)."""
    return tuple(x.fp32_precision for x in baseline._precision_backends())


def _set_legacy(allow_tf32: bool, cudnn: bool, matmul_precision: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = cudnn
    torch.set_float32_matmul_precision(matmul_precision)


def _set_fp32_precision_api() -> None:
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "ieee"


def _set_fp32_precision_all() -> None:
    torch.backends.fp32_precision = "tf32"


# What a caller may have left: each precision's flags, a mixture, "medium", and the fp32_precision API.
CALLERS = {
    "tf32": functools.partial(_set_legacy, True, True, "high"),
    "fp32": functools.partial(_set_legacy, False, False, "highest"),
    "cudnn_tf32_only": functools.partial(_set_legacy, False, True, "highest"),
    "medium": functools.partial(_set_legacy, True, False, "medium"),
    "fp32_precision_api": _set_fp32_precision_api,
    "fp32_precision_all": _set_fp32_precision_all,
}


@contextmanager
def process_flags_kept() -> Iterator[None]:
    """The process's precision flags as they were before the block, after it (the legacy setters overwrite
    the fp32_precision properties, so those go second)."""
    saved, properties = legacy_flags(), fp32_precisions()
    try:
        yield
    finally:
        _set_legacy(*saved)
        for x, value in zip(baseline._precision_backends(), properties, strict=True):
            x.fp32_precision = value


@pytest.fixture
def process_flags():
    with process_flags_kept():
        yield


def _recording_flags(step, seen: list):
    """Make `step`'s dense part append the legacy flags it runs under to `seen`."""
    dense_loss = step.dense_loss

    def recording(*args, **kwargs):
        seen.append(legacy_flags())
        return dense_loss(*args, **kwargs)

    step.dense_loss = recording


def assert_caller_flags_back(before_legacy, before_fp32_precisions) -> None:
    """The flags equal the caller's: the fp32_precision properties, and the legacy ones where the caller
    could read them."""
    assert fp32_precisions() == before_fp32_precisions
    if before_legacy is not None:
        assert legacy_flags() == before_legacy


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("precision", baseline.PRECISIONS)
def test_baseline_step_sets_its_precision_flags_and_gives_the_callers_back(precision, caller, process_flags):
    """Whatever flags the caller left, every call of the step runs under those its precision requires
    (issue 46: torch-graphed at tf32 timed slower than at fp32 after other runs in the process), and the
    caller's are back after it."""
    plain = baseline.PlainDLRM(8, [32, 8], [32, 1], TABLE_ROWS)
    step = baseline.TorchGraphedStep(plain, lr=0.1, precision=precision, compile=False, cuda_graph=False)
    seen = []
    _recording_flags(step, seen)
    CALLERS[caller]()
    before = legacy_flags(), fp32_precisions()
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        step(batch(8, generator))
        assert_caller_flags_back(*before)
    assert seen == [REQUIRED[precision]] * 2


@pytest.mark.parametrize("precision", baseline.PRECISIONS)
def test_baseline_flags_are_those_a_run_sets(precision, process_flags):
    """The baseline's flags for a precision are those dlrm.device.set_precision sets for a run of it (our
    model's steps in bench_train run under the former), after any run dlrm could have set up before."""
    for earlier in baseline.PRECISIONS:
        set_precision(earlier)
        with baseline.precision_flags(precision):
            inside = legacy_flags()
        set_precision(precision)
        assert inside == legacy_flags() == REQUIRED[precision]


@pytest.mark.parametrize("precision", baseline.PRECISIONS)
def test_bench_train_steps_set_their_precision_flags_and_give_the_callers_back(
    precision, process_flags, monkeypatch
):
    """bench_train's steps of our model (eager, compile, triton, graphed or not) run under their precision's
    flags on every call, whatever the caller left, and give the caller's back."""
    monkeypatch.syspath_prepend(str(_PATH.parent))
    import bench_train

    seen = []

    def inner(model, optimizer, batch):
        seen.append(legacy_flags())
        return torch.zeros(())

    step = bench_train.PrecisionStep(inner, precision)
    assert step.capture_s is None  # a step that does not capture: no capture time in its row
    for caller in CALLERS.values():
        caller()
        before = legacy_flags(), fp32_precisions()
        step(None, None, None)
        assert_caller_flags_back(*before)
    assert seen == [REQUIRED[precision]] * len(CALLERS)


def _cache_entries(fn) -> int:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(fn.__code__))


def test_compiled_baselines_do_not_share_dynamo_state(monkeypatch):
    """A compiled baseline built after another starts with none of its compiled code (nor its recompile
    count or dynamic-shape choices): building resets dynamo. Compiled with dynamo's "eager" backend here (no
    Inductor build on the CPU); dynamo's caches are the same."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    code = baseline.PlainDLRM.dense_loss
    generator = torch.Generator().manual_seed(4)
    first = baseline.TorchGraphedStep(
        baseline.PlainDLRM(8, [32, 8], [32, 1], TABLE_ROWS), lr=0.1, cuda_graph=False
    )
    first(batch(8, generator))
    first(batch(12, generator))  # another batch size: a recompilation, with dynamic shapes
    assert _cache_entries(code) >= 1
    second = baseline.TorchGraphedStep(
        baseline.PlainDLRM(8, [32, 8], [32, 1], TABLE_ROWS), lr=0.1, cuda_graph=False
    )
    assert _cache_entries(code) == 0
    second(batch(8, generator))
    assert _cache_entries(code) == 1  # its own compilation only
    torch._dynamo.reset()


@pytest.mark.parametrize("handed_back", [False, True])
@pytest.mark.parametrize("ended", [KeyboardInterrupt, torch.OutOfMemoryError])
def test_bench_train_keeps_the_rows_measured_before_it_stops(monkeypatch, tmp_path, ended, handed_back):
    """bench_train keeps each row as soon as it is measured: an invocation that `timeout -s INT` ends
    (KeyboardInterrupt), or that fails in a later batch (out of memory), keeps the rows measured before it
    (each whole) in the results file, or, run by `launch_each`, in the file its parent reads; the interrupt
    or the error still ends the run."""
    from dlrm import parallel

    monkeypatch.syspath_prepend(str(_PATH.parent))
    import bench_train

    results, handed = tmp_path / "train.csv", tmp_path / "rows.json"
    if handed_back:
        monkeypatch.setenv(bench_train.ROWS_ENV, str(handed))
    else:
        monkeypatch.delenv(bench_train.ROWS_ENV, raising=False)
    calls = []

    def fake_bench(config, backend, batch, *args):
        calls.append(backend)
        if len(calls) == 3:
            raise ended
        return {"config": config, "backend": backend, "batch": batch, "world_size": 1, "ms_per_step": 1.0,
                "samples_per_s": batch * 1000, "peak_mem_gib": 1.0, "first_step_s": 0.1}  # fmt: skip

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "test GPU")
    monkeypatch.setattr(bench_train.parallel, "init_distributed", lambda *a: (parallel.SINGLE, None))
    monkeypatch.setattr(bench_train, "bench", fake_bench)
    monkeypatch.setattr(bench_train, "RESULTS", results)
    with pytest.raises(ended):
        bench_train.main.callback(
            configs="kaggle", batches="128,2048", backends="torch-graphed,triton+graphs", steps=5,
            max_rows=None, precisions="tf32", ids="uniform", nproc="1", cardinalities="kaggle",
            optimizer="sgd", shardings="auto", table_dtype="fp32",
        )  # fmt: skip
    if handed_back:
        assert not results.exists()
        written = json.loads(handed.read_text())
    else:
        with results.open() as f:
            written = list(csv.DictReader(f))
    measured = [(r["backend"], str(r["batch"])) for r in written]
    assert measured == [("torch-graphed", "128"), ("triton+graphs", "128")]
