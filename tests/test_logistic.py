"""model.arch "logistic" (dlrm.model.logistic): against scikit-learn's LogisticRegression on hashed one-hot
features, and configs/logistic.json's training through the loop on every backend."""

import dataclasses
import json

import numpy as np
import pytest
import scipy.sparse
import torch
from sklearn.linear_model import LogisticRegression as SkLogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import OneHotEncoder
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm import train as train_cli
from dlrm.config import load_config, replace
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.model import LogisticRegression, model_from_checkpoint
from tests.conftest import REPO

CONFIG = REPO / "configs" / "logistic.json"


def _fixture(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Criteo-shaped rows drawn from a logistic model of their hashed features: dense [rows, N_dense] (log1p
    of counts), raw ids [rows, F] (-1 missing) of 3..12 values per feature hashed into 2..9 rows (some
    collide), labels [rows]. Returns dense, ids, labels, rows per table."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(3, 13, (NUM_SPARSE,), generator=g)
    table_rows = torch.randint(2, 10, (NUM_SPARSE,), generator=g).tolist()
    ids = (torch.rand(rows, NUM_SPARSE, generator=g) * values).long() - 1
    dense = torch.log1p(torch.poisson(torch.full((rows, NUM_DENSE), 3.0), generator=g))
    hashed = torch.remainder(ids + 1, torch.tensor(table_rows))
    truth = [torch.randn(r, generator=g) * 0.5 for r in table_rows]
    logit = -1.0 + (dense - 1.3) @ (torch.randn(NUM_DENSE, generator=g) * 0.5)
    logit = logit + sum(truth[f][hashed[:, f]] for f in range(NUM_SPARSE))
    labels = (torch.rand(rows, generator=g) < torch.sigmoid(logit)).float()
    return dense, ids, labels, table_rows


def _one_hot(dense: torch.Tensor, ids: torch.Tensor, table_rows: list[int]) -> scipy.sparse.csr_matrix:
    """[dense | one-hot of each feature's hashed row], what scikit-learn fits."""
    hashed = torch.remainder(ids + 1, torch.tensor(table_rows)).numpy()
    encoder = OneHotEncoder(categories=[np.arange(r) for r in table_rows])
    return scipy.sparse.hstack(
        [scipy.sparse.csr_matrix(dense.numpy()), encoder.fit_transform(hashed)]
    ).tocsr()


def test_logistic_matches_scikit_learn_auc():
    """Same train/test split, same features: our model (Adagrad, mini-batches, the training step's loss)
    and scikit-learn's unpenalized LogisticRegression (lbfgs to convergence) reach test AUCs within 0.01."""
    dense, ids, labels, table_rows = _fixture(0, 6000)
    train, test = slice(0, 4000), slice(4000, None)
    reference = SkLogisticRegression(C=np.inf, max_iter=2000)
    reference.fit(_one_hot(dense[train], ids[train], table_rows), labels[train].numpy())
    expected = roc_auc_score(
        labels[test], reference.decision_function(_one_hot(dense[test], ids[test], table_rows))
    )

    torch.manual_seed(0)
    model = LogisticRegression(table_rows)
    optimizer = torch.optim.Adagrad(model.dense_parameters() + model.embedding_parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(15):
        for batch in torch.randperm(4000, generator=g).split(128):
            optimizer.zero_grad()
            model.loss(model(dense[batch], ids[batch]), labels[batch]).backward()
            optimizer.step()
    with torch.no_grad():
        auc = roc_auc_score(labels[test], model(dense[test], ids[test]))
    assert 0.6 < expected  # the fixture has signal to find
    assert auc == pytest.approx(expected, abs=0.01)


def _curve(data_dir, run_dir, steps: int = 24, **train) -> tuple[list[float], dict]:
    """configs/logistic.json on the sample for `steps` steps of 256 rows, logging every step, profiler off:
    the logged train losses and the run's metrics."""
    cfg = load_config(CONFIG)
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, path=str(data_dir), batch_size=256),
        profiler=dataclasses.replace(cfg.profiler, enabled=False),
    )
    metrics = train_cli.train(
        replace(cfg, "train", max_steps=steps, epochs=1, log_interval=1, **train), run_dir
    )
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return [e.value for e in events.Scalars("train/loss")], metrics


@pytest.mark.parametrize("optimizer", ["adagrad", "sgd"])
def test_logistic_config_trains_alike_on_every_backend(criteo_sample, tmp_path, optimizer):
    """The model learns (val AUC), and eager, Inductor and our Triton kernels (the fused D = 1 table update)
    give the same loss curve and eval AUC; the checkpoint of any backend rebuilds the eager model."""
    backends = {"eager": {}, "compile": {"use_torch_compile": True}, "triton": {"use_triton": True}}
    lr = {"adagrad": 0.05, "sgd": 0.5}[optimizer]
    runs = {
        name: _curve(criteo_sample, tmp_path / name, optimizer=optimizer, lr=lr, **flags)
        for name, flags in backends.items()
    }
    curve = runs["eager"][0]
    assert len(curve) == 24  # steps 1..24
    # The model starts at the train click rate (AUC 0.5: one prediction for every row), and per-batch losses
    # of ~7 clicks in 256 rows are too noisy to fall visibly in 24 steps: what was learned shows in val AUC.
    assert runs["eager"][1]["val_auc"] > 0.6
    for name in ("compile", "triton"):
        torch.testing.assert_close(runs[name][0], curve, rtol=1e-4, atol=1e-5, msg=name)
        assert runs[name][1]["val_auc"] == pytest.approx(runs["eager"][1]["val_auc"], abs=1e-4)
        assert runs[name][1]["backend"] == name
    state = torch.load(tmp_path / "triton" / "checkpoints" / "last.pt", weights_only=True)
    if optimizer == "adagrad":  # the fused Adagrad's sums, [R, 1], nonzero on the rows looked up
        sums = state["embedding_optimizer_state"]
        assert sums.shape == (sum(state["table_rows"]), 1) and 0 < int((sums > 0).sum()) < sums.shape[0]
    cfg = load_config(CONFIG)
    model = model_from_checkpoint(cfg.model, state["table_rows"], state["model"])
    assert isinstance(model, LogisticRegression)
    assert json.loads((tmp_path / "triton" / "config.json").read_text())["model"]["arch"] == "logistic"


def test_logistic_config_matches_scikit_learn_tuned_on_val(criteo_sample, tmp_path, monkeypatch):
    """configs/logistic.json as shipped, trained by the loop on the shipped sample (seed 0, best.pt chosen
    on val), against scikit-learn's L2 LogisticRegression on the same features (log1p dense counts and a
    one-hot of each feature's row in the config's tables) with C chosen on val (scripts/quality.py's
    reference): test AUCs within 0.005."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import quality

    reference = quality.sklearn_logistic(criteo_sample)
    cfg = load_config(CONFIG)
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, path=str(criteo_sample)),
        profiler=dataclasses.replace(cfg.profiler, enabled=False),
    )
    metrics = train_cli.train(replace(cfg, "train", device="cpu"), tmp_path / "run", progress="quiet")
    assert 0.6 < reference["test_auc"]  # the sample has signal to find
    assert metrics["test_auc"] == pytest.approx(reference["test_auc"], abs=0.005), reference
