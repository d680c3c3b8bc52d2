"""The train loader chosen by data.loader, and its position in training checkpoints."""

import dataclasses

import pytest
import torch

from dlrm import train as train_cli
from dlrm.checkpoint import load_checkpoint
from dlrm.config import DataConfig, load_config, replace
from dlrm.data.dataset import BatchLoader, open_split
from dlrm.data.loaders import make_train_loader
from dlrm.data.resident import ResidentLoader
from dlrm.data.streaming import StreamingLoader
from tests.conftest import REPO


@pytest.mark.parametrize(
    ("loader", "kind"),
    [("memory", BatchLoader), ("gpu_resident", ResidentLoader), ("streaming", StreamingLoader)],
)
def test_every_loader_reads_the_whole_train_split(criteo_sample, loader, kind):
    cfg = DataConfig(path=str(criteo_sample), batch_size=1000, loader=loader, shuffle_buffer=2500, prefetch=2)
    train_loader = make_train_loader(cfg, criteo_sample, seed=3, device=torch.device("cpu"))
    assert isinstance(train_loader, kind)
    assert train_loader.num_rows == len(train_loader) * 1000 == 8000
    # Every row once: the multisets of whole rows (dense, ids, label) are equal, so a loader that repeats a
    # row and drops another fails (sorted labels alone cannot tell: most rows share a label).
    read = _rows(*(torch.cat(parts) for parts in zip(*train_loader, strict=True)))
    split = open_split(criteo_sample, "train")
    assert len(read) == 8000 and read == _rows(split.dense, split.sparse, split.label)


def _rows(dense: torch.Tensor, sparse: torch.Tensor, label: torch.Tensor) -> list[tuple]:
    """The rows [n] as sorted tuples of (13 dense floats, 26 ids, label): a multiset to compare."""
    return sorted(zip(map(tuple, dense.tolist()), map(tuple, sparse.tolist()), label.tolist(), strict=True))


def test_streaming_run_saves_the_loader_position(criteo_sample, tmp_path):
    cfg = load_config(REPO / "configs" / "tiny.json")
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, path=str(criteo_sample), loader="streaming", shuffle_buffer=3000),
    )
    metrics = train_cli.train(replace(cfg, "train", device="cpu", max_steps=5), tmp_path / "run")
    assert metrics["steps"] == 5 and metrics["samples"] == 5 * 256
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["loader"]
    assert state["epoch"] == 0 and state["batches"] == 5
    # The saved position resumes: the next batch is the sixth of the epoch.

    def loader():
        return make_train_loader(cfg.data, criteo_sample, seed=cfg.train.seed, device=torch.device("cpu"))

    expected = list(loader())[5]
    resumed = loader()
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(next(iter(resumed)), expected, strict=True))
    memory_cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, loader="memory"))
    train_cli.train(replace(memory_cfg, "train", device="cpu", max_steps=2), tmp_path / "memory")
    assert load_checkpoint(tmp_path / "memory" / "checkpoints" / "last.pt")["loader"] is None
