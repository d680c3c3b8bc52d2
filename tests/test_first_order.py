"""First-order terms (model.first_order, dlrm.model.first_order) against a direct computation: forward,
dense-layer gradients and the table updates, on every backend (eager, torch.compile, our Triton kernels in
the interpreter), and inside a DLRM."""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from dlrm import train as train_cli
from dlrm.config import ModelConfig, RunConfig, TrainConfig, load_config, replace
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.model import DLRM, model_from_checkpoint
from dlrm.model.first_order import FirstOrder
from dlrm.model.tables import build_vocabularies
from dlrm.optim import RunOptimizer
from dlrm.step import compile_dense_part
from tests.conftest import REPO

SMALL = ModelConfig(embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1), max_rows=50)
# 1 (a table of one row), primes, and a table larger than the batch's ids reach.
ROWS = [1, 7, 13, 50] + [5 + f for f in range(NUM_SPARSE - 4)]
LR, EPS = 0.1, 1e-10  # EPS: Adagrad's default, which the fused update uses


def _inputs(g: torch.Generator, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dense = torch.rand(batch, NUM_DENSE, generator=g) * 3
    sparse = torch.randint(-1, 40, (batch, NUM_SPARSE), generator=g)  # -1: missing; repeats within a batch
    labels = (torch.rand(batch, generator=g) < 0.3).float()
    return dense, sparse, labels


def _randomize(module: torch.nn.Module, g: torch.Generator) -> None:
    """Random (never zero) weights instead of the zero start, so the forward check can fail."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def _reference(tables: list[torch.Tensor], w: torch.Tensor, bias: float, dense, sparse, labels, optimizer):
    """wide = bias + dense w + sum_f table_f[(id + 1) mod rows_f] by a loop, its mean BCE loss, and the
    tables after one SGD / Adagrad step on that loss, computed with the formulas of kernels/embedding.py."""
    rows = [(sparse[:, f] + 1) % len(t) for f, t in enumerate(tables)]
    wide = bias + dense @ w + sum(t[r] for t, r in zip(tables, rows, strict=True))
    # d(mean BCE)/d(wide[b]) = (sigmoid(wide[b]) - label[b]) / B: every lookup of sample b gets it.
    dwide = (torch.sigmoid(wide) - labels) / len(labels)
    updated = []
    for t, r in zip(tables, rows, strict=True):
        g = torch.zeros_like(t).index_add_(0, r, dwide)
        step = LR * g if optimizer == "sgd" else LR * g / ((g * g).sqrt() + EPS)
        updated.append(t - step)  # rows not looked up: g = 0, no change (Adagrad's 0 / (0 + eps) = 0)
    return wide, dense.T @ dwide, dwide.sum(), updated


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("backend", ["eager", "compile", "triton"])
def test_first_order_forward_and_update_equal_the_formula(backend, optimizer):
    g = torch.Generator().manual_seed(0)
    module = FirstOrder(ROWS, kernel="triton" if backend == "triton" else "torch", bias=True)
    assert all(torch.count_nonzero(p) == 0 for p in module.parameters())  # starts at zero
    _randomize(module, g)
    tables = [t.clone() for t in module.tables.state_dict().values()]  # [rows_f, 1] each
    w, bias = module.dense.weight[0].detach().clone(), float(module.dense.bias.detach())
    dense, sparse, labels = _inputs(g, 67)

    cfg = RunConfig(train=TrainConfig(optimizer=optimizer, lr=LR))
    holder = type("Holder", (), {})()  # what RunOptimizer and compile_dense_part read of a model
    holder.dense_parameters = lambda: list(module.dense.parameters())
    holder.embedding_parameters = lambda: [] if backend == "triton" else list(module.tables.parameters())
    holder.table_archs = lambda: [module.tables]
    holder.sparse_arch, holder.dense_modules = module.tables, lambda: [module.dense]
    opt = RunOptimizer(holder, cfg.train)
    if backend == "compile":
        torch._dynamo.reset()  # a fresh compile to count (another test may have compiled the layer's code)
        compile_dense_part(holder)

    compiled_before = counters["frames"]["ok"]
    wide = module(dense, sparse)
    assert (counters["frames"]["ok"] > compiled_before) == (backend == "compile")  # Inductor ran the layer
    loss = torch.nn.functional.binary_cross_entropy_with_logits(wide, labels)
    opt.zero_grad()
    loss.backward()
    expected_wide, expected_dw, expected_db, expected_tables = _reference(
        [t[:, 0] for t in tables], w, bias, dense, sparse, labels, optimizer
    )
    assert wide.shape == (67,) and wide.dtype == torch.float32
    torch.testing.assert_close(wide, expected_wide, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(module.dense.weight.grad[0], expected_dw, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(module.dense.bias.grad[0], expected_db, rtol=1e-5, atol=1e-6)
    opt.step()
    after = list(module.tables.state_dict().values())
    for f, (got, expected) in enumerate(zip(after, expected_tables, strict=True)):
        torch.testing.assert_close(got[:, 0], expected, rtol=1e-5, atol=1e-6, msg=f"table {f}")


@pytest.mark.parametrize("hashing", ["modulus", "vocab"])
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_dlrm_first_order_adds_the_terms_to_the_plain_logit(kernel, hashing):
    """A seed builds the same DLRM with and without first-order terms (they come last, at zero); their logits
    differ by bias-free dense @ w + sum_f w_f[row], the rows those of the DLRM's own tables; checkpoints hold
    the first-order tables per table, as the embedding tables."""
    g = torch.Generator().manual_seed(1)
    dense, sparse, _ = _inputs(g, 9)
    kwargs = {"table_rows": ROWS}
    if hashing == "vocab":
        kwargs = {"vocabularies": build_vocabularies(sparse[:5], 50)}  # rows 5..8 may hit the OOV row
    models = {}
    for first_order in (False, True):
        torch.manual_seed(0)
        cfg = ModelConfig(**{**SMALL.__dict__, "hashing": hashing, "first_order": first_order})
        models[first_order] = DLRM(cfg, sparse_kernel=kernel, **kwargs).eval()
    plain, wide = models[False], models[True]
    keys = set(wide.state_dict()) - set(plain.state_dict())
    tables = {f"first_order.tables.embeddings.{f}.weight" for f in range(NUM_SPARSE)}
    assert keys == {"first_order.dense.weight"} | tables
    with torch.no_grad():
        torch.testing.assert_close(wide(dense, sparse), plain(dense, sparse), rtol=0, atol=0)  # zero start
        _randomize(wide.first_order, g)
        rows = plain.sparse_arch.hash_ids(sparse)
        state = wide.state_dict()
        terms = dense @ state["first_order.dense.weight"][0] + sum(
            state[f"first_order.tables.embeddings.{f}.weight"][rows[:, f], 0] for f in range(NUM_SPARSE)
        )
        torch.testing.assert_close(wide(dense, sparse), plain(dense, sparse) + terms, rtol=1e-5, atol=1e-5)
        table_rows = wide.sparse_arch.table_rows
        back = model_from_checkpoint(wide_cfg(hashing), table_rows, wide.state_dict()).eval()  # eager
        torch.testing.assert_close(back(dense, sparse), wide(dense, sparse), rtol=1e-5, atol=1e-6)
    ids = set(map(id, wide.dense_parameters())), set(map(id, wide.embedding_parameters()))
    assert {id(p) for p in wide.first_order.dense.parameters()} <= ids[0]
    # The torch optimizer updates the first-order tables of kernel "torch"; the kernel's backward, "triton"'s.
    assert ({id(p) for p in wide.first_order.tables.parameters()} <= ids[1]) == (kernel == "torch")


def wide_cfg(hashing: str) -> ModelConfig:
    return ModelConfig(**{**SMALL.__dict__, "hashing": hashing, "first_order": True})


def test_first_order_terms_stay_fp32_under_bf16_autocast():
    torch.manual_seed(0)
    model = DLRM(wide_cfg("modulus"), table_rows=ROWS)
    dense, sparse, _ = _inputs(torch.Generator().manual_seed(2), 4)
    with torch.autocast("cpu", torch.bfloat16):
        assert model.first_order(dense, sparse).dtype == torch.float32
        assert model(dense, sparse).dtype == torch.float32


def test_triton_adagrad_resume_restores_the_first_order_state(criteo_sample, tmp_path):
    """The first-order tables' fused Adagrad sums are checkpointed beside the embedding tables' and restored:
    2 + 2 resumed steps end at the weights of 4 uninterrupted ones."""
    cfg = load_config(REPO / "configs" / "tiny.json")
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, path=str(criteo_sample)),
        profiler=dataclasses.replace(cfg.profiler, enabled=False),
    )
    cfg = replace(cfg, "model", first_order=True)

    def run(name: str, steps: int, resume=None) -> dict:
        train_cfg = replace(cfg, "train", optimizer="adagrad", lr=0.05, use_triton=True, max_steps=steps)
        train_cli.train(train_cfg, tmp_path / name, resume=resume)
        return torch.load(tmp_path / name / "checkpoints" / "last.pt", weights_only=True)

    whole = run("whole", 4)
    run("half", 2)
    resumed = run("resumed", 4, resume=tmp_path / "half" / "checkpoints" / "last.pt")
    sums = whole["first_order_optimizer_state"]
    assert sums.shape == (sum(whole["table_rows"]), 1) and 0 < int((sums > 0).sum()) < sums.shape[0]
    assert whole["embedding_optimizer_state"].shape == (sum(whole["table_rows"]), 8)
    torch.testing.assert_close(resumed["first_order_optimizer_state"], sums, rtol=1e-6, atol=1e-7)
    for key, value in whole["model"].items():
        torch.testing.assert_close(resumed["model"][key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert torch.count_nonzero(whole["model"]["first_order.tables.embeddings.0.weight"]) > 0  # they trained
