"""LoRA fine-tuning (`python -m dlrm.finetune`): only the adapters (and unfrozen tables) change, the merged
checkpoint gives the adapted model's logits, and evaluate / train --resume read it."""

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

from dlrm import evaluate as evaluate_cli
from dlrm import finetune
from dlrm import train as train_cli
from dlrm.config import from_dict, replace
from dlrm.data.dataset import open_split
from dlrm.model import model_from_checkpoint
from dlrm.model.mlp import MLP
from tests.test_train import _tiny


@pytest.fixture(scope="module")
def base_run(criteo_sample, tmp_path_factory):
    """tiny.json trained 4 steps: the model to fine-tune."""
    run = tmp_path_factory.mktemp("base")
    cfg = _tiny(criteo_sample, max_steps=4)
    train_cli.train(dataclasses.replace(cfg, profiler=dataclasses.replace(cfg.profiler, enabled=False)), run)
    return run / "checkpoints" / "last.pt"


def _finetune(base, tmp_path, name, *args):
    result = CliRunner().invoke(
        finetune.main,
        ["--checkpoint", str(base), "--output-dir", str(tmp_path / name), "--max-steps", "3", *args],
    )
    assert result.exit_code == 0, result.output
    return torch.load(tmp_path / name / "checkpoints" / "last.pt", weights_only=True)


@pytest.mark.parametrize("freeze", [False, True], ids=["tables-train", "tables-frozen"])
def test_only_adapters_and_unfrozen_tables_change(base_run, tmp_path, freeze):
    base = torch.load(base_run, weights_only=True)["model"]
    tuned = _finetune(base_run, tmp_path, "tuned", "--lora-rank", "2", "--lora-alpha", "4",
                      *(["--freeze-embeddings"] if freeze else []))  # fmt: skip
    lora = from_dict(tuned["config"]).model.lora
    assert (lora.rank, lora.alpha, lora.base, lora.freeze_embeddings) == (2, 4.0, str(base_run), freeze)
    adapters = {k for k in tuned["model"] if ".lora_" in k}
    assert "dense_arch.mlp.lora_a.0" in adapters and "over_arch.mlp.lora_b.1" in adapters
    assert any(tuned["model"][k].abs().sum() > 0 for k in adapters if ".lora_b." in k)  # B left zero: trained
    for key, value in base.items():
        same = torch.equal(tuned["model"][key], value)
        if key.startswith("sparse_arch.embeddings") and not freeze:
            continue  # the tables train (at least the looked-up rows)
        assert same, key
    if not freeze:
        assert not all(
            torch.equal(tuned["model"][k], v) for k, v in base.items() if k.startswith("sparse_arch")
        )


def test_merged_checkpoint_gives_the_adapted_logits_and_is_read_back(base_run, criteo_sample, tmp_path):
    _finetune(base_run, tmp_path, "tuned", "--lora-rank", "3")
    tuned_path = tmp_path / "tuned" / "checkpoints" / "last.pt"
    merged_path = tmp_path / "merged.pt"
    result = CliRunner().invoke(
        finetune.main, ["--checkpoint", str(tuned_path), "--merge", "--output", str(merged_path)]
    )
    assert result.exit_code == 0, result.output
    tuned, merged = (torch.load(p, weights_only=True) for p in (tuned_path, merged_path))
    assert not any(".lora_" in k for k in merged["model"]) and merged["config"]["model"]["lora"]["rank"] == 0
    split = open_split(criteo_sample, "test")
    dense, sparse = split.dense[:64], split.sparse[:64]
    with torch.no_grad():
        logits = [
            model_from_checkpoint(from_dict(s["config"]).model, s["table_rows"], s["model"])(dense, sparse)
            for s in (tuned, merged)
        ]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)

    result = CliRunner().invoke(
        evaluate_cli.main, ["--checkpoint", str(merged_path), "--data", str(criteo_sample)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["samples"] == 1000  # the test split
    cfg = replace(from_dict(merged["config"]), "train", max_steps=merged["step"] + 2)
    metrics = train_cli.train(cfg, tmp_path / "resumed", resume=merged_path)
    assert metrics["steps"] == merged["step"] + 2


def test_errors_are_one_line(base_run, tmp_path):
    result = CliRunner().invoke(finetune.main, ["--checkpoint", str(base_run), "--merge", "--output", "x.pt"])
    assert result.exit_code == 2 and "has no adapters to merge" in result.output
    result = CliRunner().invoke(finetune.main, ["--checkpoint", str(base_run)])
    assert result.exit_code == 2 and "--lora-rank is required" in result.output


@pytest.mark.parametrize("kernel", ["linear_act", "bias_act"])
def test_lora_mlp_kernel_equals_the_eager_expression(kernel):
    """The adapted MLP through kernels/lora_linear.py and in PyTorch ops: same outputs and adapter grads."""
    torch.manual_seed(0)
    eager = MLP(13, (24, 7, 1), "relu", "identity", "torch", lora_rank=3, lora_alpha=6.0)
    fused = MLP(13, (24, 7, 1), "relu", "identity", kernel, lora_rank=3, lora_alpha=6.0)
    with torch.no_grad():
        for b in eager.lora_b:
            b.normal_()  # B starts at zero: give the adapters something to do
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(37, 13)
    outs, grads = [], []
    for mlp in (eager, fused):
        for name, p in mlp.named_parameters():
            p.requires_grad_(".lora_" in f".{name}")
        y = mlp(x)
        outs.append(y)
        grads.append(torch.autograd.grad(y.square().sum(), [*mlp.lora_a, *mlp.lora_b]))
    # fp32 both sides, sums in other orders (tests/tolerances.py "gemm").
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_finetune_on_the_gpu_follows_eager(base_run, tmp_path, precision):
    """Fine-tuning on our kernels (the fused LoRA layer), with the whole-step CUDA graph, follows eager's loss
    curve; the frozen MLP weights stay bit for bit."""
    from tests.test_train import _losses

    cfg = finetune.finetune_config(base_run, None, rank=4)
    cfg = replace(cfg, "train", max_steps=20, log_interval=1, device="cuda", precision=precision)
    cfg = dataclasses.replace(cfg, profiler=dataclasses.replace(cfg.profiler, enabled=False))
    runs = {"eager": {}, "triton_graphs": {"use_triton": True, "cuda_graphs": True}}
    curves = {}
    for name, flags in runs.items():
        train_cli.train(replace(cfg, "train", **flags), tmp_path / name)
        curves[name] = _losses(tmp_path / name)
        state = torch.load(tmp_path / name / "checkpoints" / "last.pt", weights_only=True, map_location="cpu")
        base = torch.load(base_run, weights_only=True, map_location="cpu")["model"]
        assert all(torch.equal(state["model"][k], base[k]) for k in base if ".mlp.layers." in k)
    atol = 2e-2 if precision == "bf16" else 1e-3  # bf16 rounds in other places on each path
    torch.testing.assert_close(curves["triton_graphs"], curves["eager"], rtol=0, atol=atol)
