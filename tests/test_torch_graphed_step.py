"""Tests of the plain-PyTorch baseline step of scripts/bench_train.py (scripts/torch_graphed_step.py): on the
CPU, uncompiled and uncaptured, its loss and updated weights equal our eager model's SGD step."""

import importlib.util
from pathlib import Path

import pytest
import torch

from dlrm.config import load_config, replace
from dlrm.data.dataset import Batch
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.model import DLRM
from dlrm.optim import RunOptimizer
from dlrm.step import train_step

_PATH = Path(__file__).parents[1] / "scripts" / "torch_graphed_step.py"
_SPEC = importlib.util.spec_from_file_location("torch_graphed_step", _PATH)
baseline = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(baseline)

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
