"""Tests of the plain-PyTorch DLRM-DCNv2 baseline step of scripts/bench_train.py
(scripts/torch_graphed_dcn.py): on the CPU, uncompiled and uncaptured, its loss and updated weights equal our
eager model's Adagrad step."""

from pathlib import Path

import pytest
import torch

from dlrm.config import DcnConfig, load_config, replace
from dlrm.data.dataset import Batch
from dlrm.data.schema import NUM_DENSE
from dlrm.model import DLRM
from dlrm.optim import RunOptimizer
from dlrm.step import train_step
from tests.conftest import load_script
from tests.test_torch_graphed_step import CALLERS, REQUIRED, legacy_flags, process_flags_kept

baseline = load_script("torch_graphed_dcn")  # it imports torch_graphed_step as the scripts do

# Small primes and a 1-row table; MLPerf's bag sizes, a small width (D = 8) and rank.
TABLE_ROWS = [
    1, 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97,
]  # fmt: skip
# As tests/test_torch_graphed_step.py: the same ops in the same dtypes; the room is for the order in which a
# row's lookups are summed (index_add_ over sorted rows vs a coalesced sparse gradient) and for Adagrad's
# step rounded as (-lr g) / std against (g / std) (-lr). Adagrad's first step is lr g / |g|: a row whose
# summed gradient nearly cancels moves by up to lr whatever its size, so the order of its sum shows in its
# step; atol 1e-5 is 1e-4 of the tables' lr (one such row in 8,488 differed by 1.6e-6 here).
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
# bf16 after the first step: the tables' fp32 summation order can put an activation on the other side of a
# bf16 rounding (2^-8 relative), which moves a small gradient and so its Adagrad step lr g / sqrt(sum g^2) by
# up to that share of lr (2 of 6,912 dense weights differed by 6.3e-5 here); atol 1e-3 is 2% of the dense
# lr, far below the 2x step of a wrong lr.
BF16_TOLERANCE = {"rtol": 1e-5, "atol": 1e-3}


def dcn_config(precision: str):
    cfg = load_config(Path(__file__).parents[1] / "configs" / "dlrm_dcnv2.json")
    cfg = replace(
        cfg, "model", embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(32, 16, 1), max_rows=100,
        dcn=DcnConfig(layers=2, low_rank=4),
    )  # fmt: skip
    return replace(cfg, "train", precision=precision, lr=0.05, embedding_lr=0.1, adagrad_eps=1e-8)


def batch(b: int, columns: int, generator: torch.Generator) -> Batch:
    """Random bags with ids far beyond the tables (modulus hashing), missing ids (-1) and repeated rows."""
    sparse = torch.randint(-1, 1000, (b, columns), generator=generator)
    sparse[: b // 2, 20:40] = 17  # the same row many times in a bag and across the batch: gradients add up
    dense = torch.rand(b, NUM_DENSE, generator=generator) * 3
    label = (torch.rand(b, generator=generator) < 0.3).float()
    return Batch(dense, sparse, label)


def build(precision: str, embedding_lr: float = 0.1):
    cfg = dcn_config(precision)
    torch.manual_seed(0)
    ours = DLRM(cfg.model, table_rows=TABLE_ROWS)
    optimizer = RunOptimizer(ours, cfg.train)
    m = cfg.model
    plain = baseline.PlainDCN(
        m.embedding_dim, m.bottom_mlp, m.top_mlp, TABLE_ROWS, m.multi_hot_sizes, m.dcn.layers, m.dcn.low_rank
    )
    plain.load_dlrm_state_dict(ours.state_dict())
    step = baseline.TorchGraphedDCNStep(
        plain, lr=0.05, embedding_lr=embedding_lr, eps=1e-8, precision=precision, compile=False,
        cuda_graph=False,
    )  # fmt: skip
    return cfg, ours, optimizer, plain, step


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_baseline_step_equals_our_eager_adagrad_step(precision):
    cfg, ours, optimizer, plain, step = build(precision)
    tolerance = BF16_TOLERANCE if precision == "bf16" else TOLERANCE
    before = plain.weight[:-1].clone()
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):  # later steps start from the updated weights and accumulators of both
        b = batch(37, sum(cfg.model.multi_hot_sizes), generator)
        expected = train_step(ours, optimizer, b, precision=precision)
        loss = step(b)
        torch.testing.assert_close(loss, expected.detach(), **tolerance)
    state = ours.state_dict()
    tables = torch.cat([state[f"sparse_arch.embeddings.{f}.weight"] for f in range(len(TABLE_ROWS))])
    assert not torch.equal(tables, before)  # the steps moved the tables (so the comparison means something)
    torch.testing.assert_close(plain.weight[:-1], tables, **tolerance)
    assert torch.equal(plain.weight[-1], torch.zeros_like(plain.weight[-1]))  # the spare row stays
    ours_dense = dict(ours.named_parameters())
    prefixes = ("dense_arch.mlp.layers", "interaction_arch.cross.v", "interaction_arch.cross.u")
    for prefix, layers in zip((*prefixes, "over_arch.mlp.layers"), plain.dense_modules, strict=True):
        for i, layer in enumerate(layers):
            for name, p in layer.named_parameters():
                torch.testing.assert_close(p, ours_dense[f"{prefix}.{i}.{name}"], **tolerance)


def test_a_wrong_table_learning_rate_is_caught():
    """The comparison above can fail: the dense lr taken for the tables moves them differently."""
    cfg, ours, optimizer, plain, step = build("fp32", embedding_lr=0.05)
    b = batch(16, sum(cfg.model.multi_hot_sizes), torch.Generator().manual_seed(2))
    train_step(ours, optimizer, b)
    step(b)
    tables = torch.cat([ours.state_dict()[f"sparse_arch.embeddings.{f}.weight"] for f in range(26)])
    with pytest.raises(AssertionError):
        torch.testing.assert_close(plain.weight[:-1], tables, **TOLERANCE)


def test_bad_arguments():
    with pytest.raises(ValueError, match="bag size >= 1 per table"):
        baseline.PlainDCN(8, [8], [1], TABLE_ROWS, [1] * 25, 1, 2)
    with pytest.raises(ValueError, match="bottom MLP ending in D=8"):
        baseline.PlainDCN(8, [16], [1], TABLE_ROWS, [1] * 26, 1, 2)
    plain = baseline.PlainDCN(8, [8], [1], TABLE_ROWS, [1] * 26, 1, 2)
    with pytest.raises(ValueError, match="CUDA graph needs the model on a CUDA device"):
        baseline.TorchGraphedDCNStep(plain, lr=0.1, compile=False)


@pytest.mark.parametrize("precision", REQUIRED)
def test_dcn_step_inherits_the_precision_flags(precision):
    """TorchGraphedDCNStep's calls run under its precision's flags whatever the caller left, and give the
    caller's back, as TorchGraphedStep's (tests/test_torch_graphed_step.py)."""
    cfg, _, _, _, step = build(precision)
    seen = []
    dense_loss = step.dense_loss

    def recording(*args):
        seen.append(legacy_flags())
        return dense_loss(*args)

    step.dense_loss = recording
    generator = torch.Generator().manual_seed(5)
    with process_flags_kept():
        for caller in CALLERS.values():
            caller()
            before = legacy_flags()
            step(batch(4, sum(cfg.model.multi_hot_sizes), generator))
            assert before is None or legacy_flags() == before
    assert seen == [REQUIRED[precision]] * len(CALLERS)
