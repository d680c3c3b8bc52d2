"""Multi-hot models: SparseArch pools bags on every path (eager nn.EmbeddingBag tables, our Triton kernel
in the interpreter, torch.compile of the dense part), and a whole run with bags made on the fly trains the
same on all three."""

import dataclasses
import json
import math

import pytest
import torch
from click.testing import CliRunner

from dlrm import evaluate as evaluate_cli
from dlrm import train as train_cli
from dlrm.config import MultiHotConfig, load_config, replace
from dlrm.data.bags import MLPERF_SIZES
from dlrm.data.schema import NUM_SPARSE
from dlrm.model.dlrm import SparseArch
from dlrm.optim import Adagrad
from tests.conftest import REPO
from tests.test_model_options import small_sample  # noqa: F401 - a fixture
from tests.test_train import _losses, _tiny, assert_updates_agree

SIZES = (3, 1, 2, *([1] * 20), 4, 1, 6)
ROWS = [7, 1, 50] + [13] * (NUM_SPARSE - 3)


def _bags(g: torch.Generator, batch: int, sizes=SIZES) -> torch.Tensor:
    ids = torch.randint(-1, 40, (batch, sum(sizes)), generator=g)  # repeats inside and across bags
    return ids


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_eager_bags_pool_their_rows(pooling):
    torch.manual_seed(0)
    arch = SparseArch(4, ROWS, multi_hot_sizes=SIZES, pooling=pooling)
    ids = _bags(torch.Generator().manual_seed(1), 5)
    out = arch(ids)
    assert out.shape == (5, NUM_SPARSE, 4)
    start = 0
    for f, k in enumerate(SIZES):
        rows = torch.remainder(ids[:, start : start + k] + 1, ROWS[f])
        vectors = arch.embeddings[f].weight[rows]  # [B, k, D]
        expected = vectors.sum(1) if pooling == "sum" else vectors.mean(1)
        torch.testing.assert_close(out[:, f], expected, msg=f"feature {f}")
        start += k
    with pytest.raises(ValueError, match=rf"expected bags of ids \[B, {sum(SIZES)}\]"):
        arch(ids[:, :NUM_SPARSE])


def test_one_hot_sizes_keep_the_one_hot_model():
    torch.manual_seed(0)
    plain = SparseArch(4, ROWS)
    torch.manual_seed(0)
    ones = SparseArch(4, ROWS, multi_hot_sizes=(1,) * NUM_SPARSE, pooling="mean")
    assert ones.bags is None
    ids = torch.randint(-1, 40, (6, NUM_SPARSE))
    assert torch.equal(plain(ids), ones(ids))
    bagged = SparseArch(4, ROWS, multi_hot_sizes=SIZES)
    assert bagged.state_dict().keys() == plain.state_dict().keys()  # checkpoints: the same keys
    with pytest.raises(ValueError, match="need hashing 'modulus'"):
        SparseArch(4, ROWS, hashing="index", multi_hot_sizes=SIZES)


@pytest.mark.parametrize(
    ("optimizer", "pooling"),
    [("sgd", "sum"), ("adagrad", "sum"), ("sgd", "mean"), ("rowwise_adagrad", "mean")],
)
def test_triton_bags_train_like_eager(optimizer, pooling):
    """Same seed -> same tables; two steps of the fused bag kernel (interpreter) end at the eager tables'
    weights (F.embedding_bag's sparse gradients stepped by torch.optim, or dlrm.optim's row-wise Adagrad),
    with the same outputs."""
    g = torch.Generator().manual_seed(5)
    archs, optimizers = {}, {}
    for kernel in ("torch", "triton"):
        torch.manual_seed(0)
        archs[kernel] = SparseArch(4, ROWS, kernel=kernel, multi_hot_sizes=SIZES, pooling=pooling)
    archs["triton"].configure_optimizer(optimizer, 0.1)
    if optimizer == "rowwise_adagrad":
        optimizers["torch"] = Adagrad(
            [{"params": list(archs["torch"].parameters()), "rowwise": True}], lr=0.1
        )
    else:
        optim = torch.optim.SGD if optimizer == "sgd" else torch.optim.Adagrad
        optimizers["torch"] = optim(archs["torch"].parameters(), lr=0.1)
    eager, triton = archs["torch"].state_dict(), archs["triton"].state_dict()
    assert all(torch.equal(eager[k], triton[k]) for k in eager)
    initial = eager["embeddings.2.weight"].clone()
    for _ in range(2):
        ids, target = _bags(g, 24), torch.randn(24, NUM_SPARSE, 4, generator=g)
        outputs = {}
        for kernel, arch in archs.items():
            out = arch(ids)
            (out * target).sum().backward()
            if kernel == "torch":
                optimizers[kernel].step()
                optimizers[kernel].zero_grad()
            outputs[kernel] = out.detach()
        torch.testing.assert_close(outputs["triton"], outputs["torch"], rtol=1e-5, atol=1e-5)
    eager, triton = archs["torch"].state_dict(), archs["triton"].state_dict()
    assert not torch.equal(eager["embeddings.2.weight"], initial)  # the tables trained
    for key in eager:
        torch.testing.assert_close(triton[key], eager[key], rtol=1e-5, atol=1e-5, msg=key)


def test_three_backends_agree_on_a_multi_hot_run(small_sample, tmp_path, initial_weights):  # noqa: F811
    """tiny.json with MLPerf's bags made on the fly (pareto): eager, --use-triton and --use-torch-compile
    give the same train losses and the same updates of the tables and the MLPs in 3 steps."""
    runs = {"eager": {}, "triton": {"use_triton": True}, "compile": {"use_torch_compile": True}}
    curves = {}
    for name, flags in runs.items():
        cfg = _tiny(small_sample, log_interval=1, max_steps=3, lr=0.05, **flags)
        cfg = replace(cfg, "model", multi_hot_sizes=MLPERF_SIZES)
        multi_hot = MultiHotConfig(distribution="pareto", seed=0)
        cfg = replace(cfg, "data", batch_size=64, multi_hot=multi_hot)
        cfg = dataclasses.replace(cfg, profiler=dataclasses.replace(cfg.profiler, enabled=False))
        train_cli.train(cfg, tmp_path / name)
        curves[name] = _losses(tmp_path / name)
    assert len(curves["eager"]) == 3 and all(math.isfinite(v) for v in curves["eager"])
    for name in runs.keys() - {"eager"}:
        torch.testing.assert_close(curves[name], curves["eager"], rtol=1e-5, atol=1e-5, msg=name)
    # 1e-3 of each update's norm, as tests/test_model_options.py (small first updates of the tables).
    assert_updates_agree(initial_weights, [tmp_path / name for name in runs], rtol=1e-3)


def test_main_multi_hot_config_trains_and_evaluates_on_the_sample(criteo_sample, tmp_path):
    """configs/main_multi_hot.json: MLPerf's bags made on the fly from the one-hot sample; 4 steps train,
    and dlrm.evaluate rebuilds the model and makes the same bags for the test split."""
    cfg = load_config(REPO / "configs" / "main_multi_hot.json")
    assert cfg.model.multi_hot_sizes == MLPERF_SIZES and cfg.data.multi_hot.distribution == "pareto"
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(criteo_sample)))
    cfg = dataclasses.replace(cfg, profiler=dataclasses.replace(cfg.profiler, enabled=False))
    metrics = train_cli.train(replace(cfg, "train", max_steps=4, epochs=1), tmp_path / "run")
    assert math.isfinite(metrics["train_loss"]) and 0.0 < metrics["test_auc"] < 1.0
    checkpoint = str(tmp_path / "run" / "checkpoints" / "last.pt")
    result = CliRunner().invoke(evaluate_cli.main, ["--checkpoint", checkpoint, "--data", str(criteo_sample)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["samples"] == 1000  # the test split
