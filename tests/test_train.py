"""End-to-end training on real Criteo rows: run outputs, backends agree, CLI errors."""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner
from loguru import logger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm import evaluate as evaluate_cli
from dlrm import train as train_cli
from dlrm.config import load_config, replace
from dlrm.data.binary import write_binary
from dlrm.data.dataset import open_split
from dlrm.errors import Interrupted
from dlrm.run import selection
from dlrm.run import setup as run_setup
from dlrm.run.setup import set_up
from tests.conftest import REPO

TINY = REPO / "configs" / "tiny.json"


def _tiny(data_dir, **train):
    cfg = load_config(TINY)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(data_dir)))
    return replace(cfg, "train", **train)  # device auto: CPU in CI, CUDA on a GPU machine


def _losses(run_dir) -> list[float]:
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return [e.value for e in events.Scalars("train/loss")]


def _updates(initial: dict[str, torch.Tensor], run_dir) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A run's update of its embedding tables ("tables") and of its other weights ("mlps": the MLPs, the
    interaction's, the first-order dense layer's): last.pt's weights minus the initial ones, one fp32 vector
    each, with the bound on one unit in the last place of each final weight (|w| eps of its dtype)."""
    final = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    parts = {"tables": [], "mlps": []}
    for key, value in initial.items():
        part = "tables" if ".embeddings." in key else "mlps"
        weight = final[key].cpu()
        ulp = weight.float().abs() * torch.finfo(weight.dtype).eps
        parts[part].append(((weight.float() - value).flatten(), ulp.flatten()))
    return {part: tuple(map(torch.cat, zip(*pairs, strict=True))) for part, pairs in parts.items()}


# `assert_updates_agree`'s rtol for runs of tens of steps on the GPU, per precision. A part that does not
# learn is off by 1.0, 10x the loosest. bf16: unit roundoff u = 2**-9; each path rounds activations and
# gradients to bf16 in other places (lookup, each layer, the interaction; forward and backward), ~20 roundings
# of u each along a step, which 30-50 SGD steps carry on (6 steps on the CPU: 7e-3 of the update's norm, 3.6
# u): 0.1. tf32: u = 2**-11 for the GEMM operands, 4x less: 2.5e-2. fp32: sums in other orders only
# (~sqrt(n) * 2**-24 each; 6e-7 in 6 CPU steps), 50 steps: 1e-3.
UPDATE_RTOL = {"bf16": 0.1, "tf32": 2.5e-2, "fp32": 1e-3}


def assert_updates_agree(initial: list[dict[str, torch.Tensor]], run_dirs: list, rtol: float) -> None:
    """Runs started in the order of `run_dirs` (the first the reference): all start from the same weights,
    the reference's tables and MLPs both moved, and every other run's update of each (`_updates`) equals the
    reference's within `rtol` of the reference's norm. This sees what a loss curve may not: a part that does
    not learn in every run moves by exactly 0; one that does not learn in one run differs from the
    reference's update by its whole norm (relative difference 1). An element whose update differs by at
    most one unit in the last place of its weight counts as equal: the update is a difference of two
    weights, known to that unit, and a step of a few units (the tables' first steps on the CPU, where the
    logit layer starts at zero weights: ~10 units) rounds differently on two paths now and then (one of
    30,713 moved table elements, one unit: 1.4e-4 of the update's norm)."""
    assert len(initial) == len(run_dirs)
    for weights in initial[1:]:
        for key, value in weights.items():
            torch.testing.assert_close(value, initial[0][key], rtol=0, atol=0, msg=key)
    reference = _updates(initial[0], run_dirs[0])
    for part, (update, _) in reference.items():
        assert update.norm() > 0, f"{run_dirs[0].name}: its {part} did not change"
    for weights, run_dir in zip(initial[1:], run_dirs[1:], strict=True):
        for part, (update, ulp) in _updates(weights, run_dir).items():
            expected, expected_ulp = reference[part]
            off = update - expected
            off = torch.where(off.abs() <= torch.maximum(ulp, expected_ulp), 0.0, off)
            error = (off.norm() / expected.norm()).item()
            assert error <= rtol, f"{run_dir.name}: {part} update {error:.2e} off {run_dirs[0].name}'s"


def test_tiny_run_writes_events_trace_checkpoints_and_metrics(criteo_sample, tmp_path):
    run = tmp_path / "run"
    metrics = train_cli.train(_tiny(criteo_sample), run)
    on_disk = json.loads((run / "metrics.json").read_text())
    assert on_disk == metrics
    expected = {
        "steps",
        "samples",
        "train_loss",
        "val_auc",
        "val_logloss",
        "val_ne",
        "best_step",
        "test_auc",
        "test_logloss",
        "test_ne",
        "samples_per_s",
        "wall_s",
        "backend",
    }
    assert expected <= set(metrics)
    assert metrics["steps"] == 8 and metrics["samples"] == 8 * 256 and metrics["backend"] == "eager"
    assert 0.0 < metrics["val_auc"] < 1.0 and metrics["val_logloss"] > 0 and metrics["val_ne"] > 0
    assert 0.0 < metrics["test_auc"] < 1.0 and metrics["test_logloss"] > 0 and metrics["test_ne"] > 0
    assert not any(key.startswith("eval_") and key != "eval_s" for key in metrics)
    assert json.loads((run / "config.json").read_text())["name"] == "tiny"
    assert list(run.glob("events.out.tfevents.*"))
    traces = list(run.glob("*.pt.trace.json"))
    assert len(traces) == 1
    trace_names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    for stage in (
        "data",
        "embedding",
        "bottom_mlp",
        "interaction",
        "top_mlp",
        "loss",
        "backward",
        "optimizer",
    ):
        assert stage in trace_names, stage
    events = EventAccumulator(str(run))
    events.Reload()
    for tag in (
        "train/loss",
        "perf/samples_per_s",
        "train/lr",
        *(f"{s}/{k}" for s in ("val", "test") for k in AUC_NE),
    ):
        assert tag in events.Tags()["scalars"], tag
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert state["step"] == 8 and "optimizer" in state

    # python -m dlrm.evaluate: --split test by default, the numbers metrics.json reports.
    for extra, split in (([], "test"), (["--split", "val"], "val")):
        result = _evaluate(run / "checkpoints" / "best.pt", criteo_sample, *extra)
        assert result["split"] == split and result["samples"] == 1000
        for key in AUC_NE:
            assert result[key] == pytest.approx(metrics[f"{split}_{key}"], abs=1e-6), (split, key)


AUC_NE = ("auc", "logloss", "ne")


def _evaluate(checkpoint, data_dir, *extra) -> dict:
    result = CliRunner().invoke(
        evaluate_cli.main, ["--checkpoint", str(checkpoint), "--data", str(data_dir), *extra]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _scalars(run_dir, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


# Val metrics scripted per train.select_on: the selected one is best at step 4 (the second evaluation),
# the other at step 2, so a selection on the wrong metric picks another step.
SCRIPTED_VAL = {
    "auc": {"auc": [0.60, 0.80, 0.70, 0.65], "logloss": [0.10, 0.20, 0.30, 0.40]},
    "logloss": {"auc": [0.80, 0.60, 0.70, 0.65], "logloss": [0.50, 0.30, 0.40, 0.45]},
}


@pytest.mark.parametrize("select_on", ["logloss", "auc"])
def test_selection_reads_val_only_and_test_reports_the_selected_weights(
    criteo_sample, tmp_path, monkeypatch, select_on
):
    """Val `select_on` (train.select_on) scripted to be best at step 4 (evaluations every 2 steps, patience
    2: early stop at step 8), the other metric at step 2, while the weights go on changing: best_step,
    best.pt and val_* follow val's `select_on` alone; test is read once, at the end, and test_* are the real
    test metrics of best.pt's weights (step 4), not of the last ones."""
    scripted = {key: iter(values) for key, values in SCRIPTED_VAL[select_on].items()}
    calls = []
    real = selection.evaluate_split

    def scripted_val(run, loader, split):
        calls.append(split)
        result = real(run, loader, split)
        return {**result, **{k: next(v) for k, v in scripted.items()}} if split == "val" else result

    monkeypatch.setattr(selection, "evaluate_split", scripted_val)
    run = tmp_path / "run"
    cfg = _tiny(criteo_sample, max_steps=12, eval_interval=2, patience=2, log_interval=2, select_on=select_on)
    metrics = train_cli.train(
        dataclasses.replace(cfg, profiler=dataclasses.replace(cfg.profiler, enabled=False)), run
    )
    assert calls == ["val"] * 4 + ["test"]
    assert metrics["steps"] == 8 and metrics["stopped"] is None  # early stopping, 4 short of max_steps
    expected = SCRIPTED_VAL[select_on]
    assert metrics["best_step"] == 4 and metrics[f"val_{select_on}"] == expected[select_on][1]
    assert metrics["last_val_auc"] == expected["auc"][3]
    assert torch.load(run / "checkpoints" / "best.pt", weights_only=True)["step"] == 4

    selected = _evaluate(run / "checkpoints" / "best.pt", criteo_sample)
    last = _evaluate(run / "checkpoints" / "last.pt", criteo_sample)
    for key in AUC_NE:
        assert metrics[f"test_{key}"] == pytest.approx(selected[key], abs=1e-6), key
    assert abs(last["auc"] - selected["auc"]) > 1e-3, (last, selected)  # the last weights report otherwise
    assert [step for step, _ in _scalars(run, "val/auc")] == [2, 4, 6, 8]
    assert _scalars(run, "test/auc") == [(4, pytest.approx(metrics["test_auc"]))]
    assert _scalars(run, "test/ne") == [(4, pytest.approx(metrics["test_ne"]))]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("use_triton", [False, True])
def test_evaluate_of_best_pt_reproduces_the_runs_test_numbers(
    criteo_sample, tmp_path, monkeypatch, use_triton, precision
):
    """main.json's model (vocab hashing, first-order terms) with best.pt from an earlier step than the last
    (val scripted to peak at step 4), a partial last eval batch, in each precision, eager and under
    --use-triton (on a GPU: the whole-step and evaluation CUDA graphs, which must read the loaded best
    weights): the run's test numbers equal `dlrm.evaluate` of best.pt, which scores in the run's kernels
    and precision by default."""
    scripted = iter([(0.60, 0.50), (0.80, 0.40), (0.70, 0.45), (0.65, 0.47)])  # (auc, logloss): best at 4
    real = selection.evaluate_split

    def scripted_val(run, loader, split):
        result = real(run, loader, split)
        if split != "val":
            return result
        auc, logloss = next(scripted)
        return {**result, "auc": auc, "logloss": logloss}

    monkeypatch.setattr(selection, "evaluate_split", scripted_val)
    cfg = _tiny(criteo_sample, max_steps=8, eval_interval=2, patience=2, log_interval=2)
    cfg = replace(cfg, "model", hashing="vocab", min_frequency=2, first_order=True)
    cfg = replace(cfg, "data", eval_batch_size=384)  # 1,000 test rows: 384 + 384 + a partial 232
    cfg = replace(cfg, "train", use_triton=use_triton, precision=precision)
    cfg = dataclasses.replace(cfg, profiler=dataclasses.replace(cfg.profiler, enabled=False))
    run = tmp_path / "run"
    metrics = train_cli.train(cfg, run)
    assert metrics["best_step"] == 4 and metrics["steps"] == 8
    result = _evaluate(run / "checkpoints" / "best.pt", criteo_sample)
    for key in AUC_NE:
        assert result[key] == pytest.approx(metrics[f"test_{key}"], abs=1e-6), key


def test_a_run_resumed_elsewhere_reports_test_of_the_best_it_resumed_with(
    criteo_sample, tmp_path, monkeypatch
):
    """Resumed into another directory with no better val evaluation after it: the selected weights are the
    first run's best.pt (step 4), which the test evaluation loads from there."""
    train_cli.train(_tiny(criteo_sample, max_steps=4), tmp_path / "first")
    real = selection.evaluate_split

    def worse_val(run, loader, split):  # every later val evaluation worse than the first run's best
        result = real(run, loader, split)
        return {**result, "auc": 0.01, "logloss": 100.0} if split == "val" else result

    monkeypatch.setattr(selection, "evaluate_split", worse_val)
    resume = tmp_path / "first" / "checkpoints" / "last.pt"
    metrics = train_cli.train(_tiny(criteo_sample, max_steps=8), tmp_path / "second", resume=resume)
    assert metrics["best_step"] == 4 and not (tmp_path / "second" / "checkpoints" / "best.pt").exists()
    selected = _evaluate(tmp_path / "first" / "checkpoints" / "best.pt", criteo_sample)
    for key in AUC_NE:
        assert metrics[f"test_{key}"] == pytest.approx(selected[key], abs=1e-6), key


def test_no_finite_val_evaluation_reports_null_test_numbers(criteo_sample, tmp_path, monkeypatch):
    """Without a finite val evaluation there is no best.pt and no selected weights: test_* are null
    (strict JSON), and the test split is never read."""
    calls = []

    def nan_val(run, loader, split):
        calls.append(split)
        return {"auc": float("nan"), "logloss": float("nan"), "ne": float("nan"), "samples": 1000}

    monkeypatch.setattr(selection, "evaluate_split", nan_val)
    metrics = train_cli.train(_tiny(criteo_sample, max_steps=4), tmp_path / "run")
    assert calls == ["val"] and not (tmp_path / "run" / "checkpoints" / "best.pt").exists()
    on_disk = json.loads((tmp_path / "run" / "metrics.json").read_text(), parse_constant=pytest.fail)
    for key in ("val_auc", "best_step", "test_auc", "test_logloss", "test_ne"):
        assert on_disk[key] is None and metrics[key] is None, key


def test_a_train_eval_directory_of_an_older_preprocess_is_refused(criteo_sample, tmp_path):
    """Splits train / eval (no val / test): training and evaluate stop with one line that says how to
    write the directory again, instead of selecting on the split they report."""
    old = tmp_path / "old"
    old.mkdir()
    metadata = json.loads((criteo_sample / "metadata.json").read_text())
    (old / "train").symlink_to(criteo_sample / "train")
    (old / "eval").symlink_to(criteo_sample / "val")
    files, rows = metadata["files"], metadata["rows"]
    metadata["files"] = {"train": files["train"], "eval": [f.replace("val/", "eval/") for f in files["val"]]}
    metadata["rows"] = {"train": rows["train"], "eval": rows["val"]}
    (old / "metadata.json").write_text(json.dumps(metadata))
    command = f"re-run: python -m dlrm.data.preprocess --input {REPO / 'data' / 'day_0_head10k.tsv.gz'} "
    command += f"--output-dir {old} --overwrite"
    with pytest.raises(ValueError, match=f"{old} has splits train, eval, no val / test") as err:
        train_cli.train(_tiny(old, max_steps=2), tmp_path / "run")
    assert str(err.value).endswith(command) and not (tmp_path / "run").exists()
    result = CliRunner().invoke(
        evaluate_cli.main, ["--checkpoint", str(tmp_path / "none.pt"), "--data", str(old)]
    )
    assert result.exit_code == 2 and result.output.strip().endswith(command)


def _loss_curves(
    data_dir, tmp_path, runs: dict[str, dict], steps: int = 6, data: dict | None = None
) -> dict[str, list[float]]:
    """Train tiny.json for `steps` steps per run (name -> train overrides; `data` overrides for all),
    profiler off; the logged losses."""
    curves = {}
    for name, flags in runs.items():
        cfg = _tiny(data_dir, log_interval=1, max_steps=steps, epochs=1 + steps // 31, **flags)
        cfg = replace(cfg, "data", **(data or {}))
        train_cli.train(
            dataclasses.replace(cfg, profiler=dataclasses.replace(cfg.profiler, enabled=False)),
            tmp_path / name,
        )
        curves[name] = _losses(tmp_path / name)
    return curves


def test_backends_give_the_same_loss_curve(criteo_sample, tmp_path, initial_weights):
    runs = {
        "eager": {},
        "compile": {"use_torch_compile": True},
        "triton": {"use_triton": True},
        "triton_bias_act": {"use_triton": True, "triton_mlp_kernel": "bias_act"},
    }
    curves = _loss_curves(criteo_sample, tmp_path, runs)
    assert len(curves["eager"]) == 6  # steps 1..6: step 1 (compile) is timed apart, its loss is logged
    # fp32 on every path, sums in other orders: a sum of n terms is off by ~sqrt(n) * 2**-24 relative (n <=
    # 256 rows, ~1e-6), and 6 steps keep the weights that close (seen 6e-7 of the update's norm): 1e-5 of
    # the update's norm, 1e-5 of the loss (~0.5). A part that does not learn on one path is off by its whole
    # update (1.0); the loss curve alone moves less than that (see `assert_updates_agree`).
    for name in ("compile", "triton", "triton_bias_act"):
        torch.testing.assert_close(curves[name], curves["eager"], rtol=1e-5, atol=1e-5, msg=name)
    assert_updates_agree(initial_weights, [tmp_path / name for name in runs], rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_compile_takes_the_whole_step_graph_and_trains_like_eager(
    criteo_sample, tmp_path, initial_weights, optimizer
):
    """--use-torch-compile on one GPU: the whole step one CUDA graph around the compiled dense part, the
    tables plain PyTorch that update themselves in backward ("torch_fused"); the losses and updates of
    eager's (fp32: the loss curve to test_backends_give_the_same_loss_curve's 1e-5; the updates to the GPU's
    fp32 UPDATE_RTOL: the fused update sums a row's repeats with atomics, in an order that changes run to run,
    and Adagrad's first step g / (|g| + eps) turns the rounding of a sum that nearly cancels into a step of
    up to lr: 1.1e-5 of the update's norm in one of two H200 runs of the same code)."""
    runs = {
        "eager": {"optimizer": optimizer, "lr": 0.05},
        "compile": {"optimizer": optimizer, "lr": 0.05, "use_torch_compile": True},
    }
    curves = _loss_curves(criteo_sample, tmp_path, runs)
    resolved = json.loads((tmp_path / "compile" / "config.json").read_text())["train"]
    assert resolved["cuda_graphs"] is True
    metrics = json.loads((tmp_path / "compile" / "metrics.json").read_text())
    assert metrics["sparse_kernel"] == "torch_fused"
    torch.testing.assert_close(curves["compile"], curves["eager"], rtol=1e-5, atol=1e-5)
    assert_updates_agree(initial_weights, [tmp_path / name for name in runs], UPDATE_RTOL["fp32"])


def test_adagrad_and_vocab_hashing_train(criteo_sample, tmp_path):
    cfg = _tiny(criteo_sample, optimizer="adagrad", lr=0.05)
    cfg = replace(cfg, "model", hashing="vocab")
    metrics = train_cli.train(cfg, tmp_path / "run")
    assert metrics["steps"] == 8 and 0.0 < metrics["val_auc"] < 1.0 and 0.0 < metrics["test_auc"] < 1.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "missing.json"], "missing.json: config file not found"),
        (["--config", str(TINY), "--max-steps", "0"], "--max-steps"),
    ],
)
def test_cli_errors(args, message):
    result = CliRunner().invoke(train_cli.main, args)
    assert result.exit_code == 2
    assert message in result.output


def test_cli_reports_missing_data_dir(tmp_path):
    config = tmp_path / "c.json"
    raw = json.loads(TINY.read_text())
    raw["data"]["path"] = str(tmp_path / "nowhere")
    config.write_text(json.dumps(raw))
    result = CliRunner().invoke(train_cli.main, ["--config", str(config), "--device", "cpu"])
    assert result.exit_code == 2
    assert "nowhere" in result.output and "metadata.json" in result.output


def test_triton_on_cpu_after_triton_import_is_a_clear_error(criteo_sample, tmp_path):
    """The interpreter must be chosen before triton is imported; a late --use-triton on CPU says so."""
    config = tmp_path / "c.json"
    raw = json.loads(TINY.read_text())
    raw["data"]["path"] = str(criteo_sample)
    config.write_text(json.dumps(raw))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import sys, triton; from dlrm.train import main; "
        f"main(['--config', {str(config)!r}, '--use-triton', '--device', 'cpu', '--max-steps', '1'])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert result.returncode == 2
    assert "set TRITON_INTERPRET=1" in result.stderr and "Traceback" not in result.stderr


def test_kaggle_layout_trains_and_selects_on_val(tmp_path):
    from dlrm.data.preprocess import preprocess

    data = tmp_path / "kaggle"
    preprocess([REPO / "data" / "day_0_head10k.tsv.gz"], data, layout="kaggle")
    metrics = train_cli.train(_tiny(data, max_steps=4), tmp_path / "run")
    assert metrics["val_samples"] == metrics["test_samples"] == 714
    result = CliRunner().invoke(
        evaluate_cli.main,
        [
            "--checkpoint",
            str(tmp_path / "run" / "checkpoints" / "best.pt"),
            "--data",
            str(data),
            "--split",
            "test",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["samples"] == 714


def test_bf16_precision_trains(criteo_sample, tmp_path):
    metrics = train_cli.train(_tiny(criteo_sample, precision="bf16", max_steps=4), tmp_path / "run")
    assert metrics["steps"] == 4 and math.isfinite(metrics["train_loss"]) and 0.0 < metrics["test_auc"] < 1.0


@pytest.mark.gpu
def test_triton_bf16_and_cuda_graphs_follow_eager(criteo_sample, tmp_path, initial_weights):
    """bf16 autocast through our kernels, and the graph-captured step, give eager bf16's loss curve;
    `--use-triton` alone (train.cuda_graphs null) takes the graph."""
    runs = {
        "eager": {"precision": "bf16"},
        "triton": {"use_triton": True, "cuda_graphs": False, "precision": "bf16"},
        "triton_graphs": {"use_triton": True, "cuda_graphs": True, "precision": "bf16"},
        "triton_default": {"use_triton": True, "precision": "bf16"},
    }
    curves = _loss_curves(criteo_sample, tmp_path, runs)
    resolved = json.loads((tmp_path / "triton_default" / "config.json").read_text())["train"]
    assert resolved["cuda_graphs"] is True
    # bf16 rounds the activations (unit roundoff 2**-9) in different places on each path: a logit through
    # ~8 such roundings is off by up to 8 * 2**-9 = 1.6e-2 of itself, and the loss (slope <= 1 in the logit)
    # by as much of the logits' size: rtol 2e-2, atol 1e-3 for losses near 0. Frozen tables move 6 steps'
    # loss by less than that: the updates are compared too.
    for name in ("triton", "triton_graphs", "triton_default"):
        torch.testing.assert_close(curves[name], curves["eager"], rtol=2e-2, atol=1e-3, msg=name)
    assert_updates_agree(initial_weights, [tmp_path / name for name in runs], UPDATE_RTOL["bf16"])


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("loader", ["memory", "gpu_resident", "streaming", "binary"])
def test_every_loader_trains_with_cuda_graphs_like_eager(
    criteo_sample, tmp_path, initial_weights, loader, precision
):
    """50 steps (an epoch end with its evaluation inside) per loader: our kernels with and without the
    whole-step CUDA graph, and (fp32) Inductor's reduce-overhead graphs, follow eager's loss curve on the
    same batches. The streaming loader prefetches on its thread meanwhile (issue 12's capture crash)."""
    if loader == "binary":
        write_binary(criteo_sample, ["train"])
    runs = {
        "eager": {"precision": precision},
        "triton": {"use_triton": True, "cuda_graphs": False, "precision": precision},
        "triton_graphs": {"use_triton": True, "cuda_graphs": True, "precision": precision},
    }
    if precision == "fp32":
        runs["compile_ro"] = {"use_torch_compile": True, "compile_mode": "reduce-overhead"}
    data = {"loader": loader, "shuffle_buffer": 1000, "prefetch": 4}
    curves = _loss_curves(criteo_sample, tmp_path, runs, steps=50, data=data)
    assert len(curves["eager"]) == 50  # every step, the first and the partial batch's timed apart too
    # bf16: as test_triton_bf16_and_cuda_graphs_follow_eager (~8 roundings of 2**-9 along a logit). fp32:
    # the kernels' summation orders differ (~sqrt(n) * 2**-24 per sum), which 50 SGD steps amplify past the
    # 6-step test's 1e-5. The updates are compared too (a frozen part moves the curve less than this).
    rtol, atol = (2e-2, 1e-3) if precision == "bf16" else (1e-3, 1e-4)
    for name in runs.keys() - {"eager"}:
        torch.testing.assert_close(curves[name], curves["eager"], rtol=rtol, atol=atol, msg=name)
    assert_updates_agree(initial_weights, [tmp_path / name for name in runs], UPDATE_RTOL[precision])


def test_triton_adagrad_checkpoint_keeps_the_embedding_state(criteo_sample, tmp_path):
    """The fused Adagrad's accumulators are not in the torch optimizer: the checkpoint carries them."""
    metrics = train_cli.train(
        _tiny(criteo_sample, optimizer="adagrad", lr=0.05, use_triton=True, max_steps=3), tmp_path / "run"
    )
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    accumulators = state["embedding_optimizer_state"]
    rows = sum(state["table_rows"])
    assert metrics["steps"] == 3 and accumulators.shape[0] == rows
    assert 0 < int((accumulators > 0).any(dim=1).sum()) < rows  # only looked-up rows have any


@pytest.mark.parametrize("loader", ["memory", "streaming", "binary"])
def test_resume_gives_the_weights_of_an_uninterrupted_run(criteo_sample, tmp_path, loader):
    if loader == "binary":
        write_binary(criteo_sample, ["train"])

    def run(name: str, max_steps: int, resume=None) -> dict:
        cfg = replace(_tiny(criteo_sample, max_steps=max_steps), "data", loader=loader, shuffle_buffer=1000)
        metrics = train_cli.train(cfg, tmp_path / name, resume=resume)
        return metrics, torch.load(tmp_path / name / "checkpoints" / "last.pt", weights_only=True)

    whole_metrics, whole = run("whole", 8)
    run("first_half", 4)
    metrics, resumed = run("second_half", 8, resume=tmp_path / "first_half" / "checkpoints" / "last.pt")
    assert resumed["step"] == whole["step"] == 8 and metrics["samples"] == 8 * 256  # the whole run
    for key, value in whole["model"].items():
        torch.testing.assert_close(resumed["model"][key], value, rtol=1e-6, atol=1e-7, msg=key)
    for key in ("val_auc", "best_step", "test_auc", "test_logloss"):
        assert metrics[key] == pytest.approx(whole_metrics[key], abs=1e-6), key


def test_a_run_stopped_mid_log_interval_resumes_to_the_logged_losses_of_an_uninterrupted_run(
    criteo_sample, tmp_path, monkeypatch
):
    """SIGTERM at step 6 (log lines every 4 steps): last.pt holds the sums of steps 5-6, so the resumed run's
    line at step 8 averages steps 5-8 as the uninterrupted run's does, to the bit (both read the losses at
    the same steps: checkpoints every 2), in TensorBoard and in metrics.json."""
    cfg = _tiny(criteo_sample, max_steps=10, device="cpu", checkpoint_interval=2)
    whole = train_cli.train(cfg, tmp_path / "whole")
    build_step = run_setup.build_step

    def terminated_at_step_6(model, optimizer, cfg, device, reduce_grads=None):
        step, calls = build_step(model, optimizer, cfg, device, reduce_grads), [0]

        def terminated(model, optimizer, batch):
            calls[0] += 1
            if calls[0] == 6:
                os.kill(os.getpid(), signal.SIGTERM)
            return step(model, optimizer, batch)

        return terminated

    with monkeypatch.context() as patched:
        patched.setattr(run_setup, "build_step", terminated_at_step_6)
        with pytest.raises(Interrupted, match="after step 6"):
            train_cli.train(cfg, tmp_path / "stopped")
    resumed = train_cli.train(cfg, resume=tmp_path / "stopped" / "checkpoints" / "last.pt")
    events = EventAccumulator(str(tmp_path / "stopped"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [4, 8, 10]
    assert _losses(tmp_path / "stopped") == _losses(tmp_path / "whole")
    assert resumed["train_loss"] == whole["train_loss"] and resumed["steps"] == 10


def test_resume_refuses_another_model(criteo_sample, tmp_path):
    train_cli.train(_tiny(criteo_sample, max_steps=2), tmp_path / "run")
    cfg = replace(_tiny(criteo_sample, max_steps=4), "model", embedding_dim=4, bottom_mlp=(32, 4))
    with pytest.raises(ValueError, match="trained with model.embedding_dim = 8, the config has 4"):
        train_cli.train(cfg, tmp_path / "other", resume=tmp_path / "run" / "checkpoints" / "last.pt")


def test_resume_command_repeats_the_options_given_including_the_off_side_of_a_pair():
    args = ["--config", "c.json", "--use-triton", "--no-cuda-graphs", "--seed", "3", "--output-dir", "r"]
    ctx = train_cli.main.make_context("train", args)
    command = train_cli.resume_command(ctx, REPO / "r" / "last.pt")
    assert command.endswith(
        f"--config c.json --use-triton --no-cuda-graphs --seed 3 --resume {REPO}/r/last.pt"
    )
    ctx = train_cli.main.make_context("train", ["--config", "c.json"])
    assert "cuda-graphs" not in train_cli.resume_command(ctx, REPO / "last.pt")  # unset: the config decides


def _three_epochs_at_batch_3000(criteo_sample, tmp_path) -> tuple[dict, list[str]]:
    """The tiny config trained 3 epochs at batch 3,000, a log line every step: metrics.json, the log lines."""
    cfg = _tiny(criteo_sample, epochs=3, max_steps=None, log_interval=1)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=3000))
    lines = []
    sink = logger.add(lines.append, format="{message}")
    try:
        metrics = train_cli.train(cfg, tmp_path / "run")
    finally:
        logger.remove(sink)
    return metrics, lines


def test_the_first_step_of_a_new_batch_size_is_timed_apart(criteo_sample, tmp_path, monkeypatch):
    """8,000 train rows at batch 3,000: two full batches and a 2,000-row one per epoch. The step of a new
    batch size pays for its kernels' compilation (here: the clock jumps 1,000 s the first time a size is seen
    after the first step); that step is logged apart and kept out of samples/s, like the first step, and only
    once."""
    from dlrm.run import setup as run_setup

    build_step, real_clock, jump = run_setup.build_step, time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + jump[0])

    def slow_on_new_sizes(*args, **kwargs):
        step, seen = build_step(*args, **kwargs), set()

        def run(model, optimizer, batch):
            if seen and len(batch.label) not in seen:
                jump[0] += 1000.0
            seen.add(len(batch.label))
            return step(model, optimizer, batch)

        return run

    monkeypatch.setattr(run_setup, "build_step", slow_on_new_sizes)
    metrics, lines = _three_epochs_at_batch_3000(criteo_sample, tmp_path)
    assert metrics["steps"] == 9 and metrics["samples"] == 3 * 8000
    # Counted, the jump alone would make the 7 timed steps' mean >= 1,000,000 / 7 ms, far above any real
    # step's time, so the machine's load cannot decide it.
    assert metrics["step_ms_max"] < 1_000_000 / 7, metrics["step_ms_max"]
    assert sum("first of batch size 2000" in line for line in lines) == 1


def test_the_cuda_graph_warm_up_and_capture_steps_are_timed_apart(criteo_sample, tmp_path, monkeypatch):
    """A graphed step (dlrm.graphs.GraphedTrainStep) runs uncaptured warm-up steps and a capture before it
    replays, one-time work like compilation. A stand-in runs the plain step and replays from its 4th call of
    a batch size; each call before takes 1,000 s (the clock jumps). At batch 3,000 over 8,000 rows for 3
    epochs (sizes 3,000, 3,000, 2,000 an epoch) the steps 1-4 and 6 and 9 are timed apart: only steps 5, 7
    and 8 count in samples/s, and each apart step is logged with its reason."""
    from dlrm.graphs import GraphedTrainStep

    build_step, real_clock, jump = run_setup.build_step, time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + jump[0])

    class WarmingStep(GraphedTrainStep):
        def __init__(self, step):  # noqa: D107 (no CUDA graph: the plain step, counted)
            self.step, self.calls = step, {}

        def replays(self, rows: int) -> bool:
            return self.calls.get(rows, 0) >= 3

        def __call__(self, model, optimizer, batch):
            rows = len(batch.label)
            if not self.replays(rows):
                jump[0] += 1000.0
            self.calls[rows] = self.calls.get(rows, 0) + 1
            return self.step(model, optimizer, batch)

    monkeypatch.setattr(run_setup, "build_step", lambda *a, **k: WarmingStep(build_step(*a, **k)))
    metrics, lines = _three_epochs_at_batch_3000(criteo_sample, tmp_path)
    assert metrics["steps"] == 9
    # The mean over the timed steps (at most 8): one jump counted would make it >= 1,000,000 / 8 ms.
    assert metrics["step_ms_max"] < 1_000_000 / 8, metrics["step_ms_max"]
    assert sum("first of batch size 2000" in line for line in lines) == 1
    assert sum("graph warm-up or capture at batch size 3000" in line for line in lines) == 2
    assert sum("graph warm-up or capture at batch size 2000" in line for line in lines) == 2


@pytest.mark.parametrize(
    ("config", "loader"), [("main.json", "memory"), ("logistic.json", "memory"), ("tiny.json", "streaming")]
)
def test_a_fresh_model_predicts_the_train_click_rate(criteo_sample, tmp_path, config, loader):
    """Before the first step every train row's prediction is the train split's click rate (the logit
    layer's bias at its log-odds), from the labels held in memory or, for a loader that streams them,
    from metadata.json; the bias is a weight of the model, so checkpoints carry it."""
    cfg = load_config(REPO / "configs" / config)
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, path=str(criteo_sample), loader=loader),
        profiler=dataclasses.replace(cfg.profiler, enabled=False),
    )
    run, _ = set_up(cfg, tmp_path / "run", None)
    run.writer.close()
    train = open_split(criteo_sample, "train")
    with torch.no_grad():
        p = torch.sigmoid(run.model(train.dense.to(run.device), train.sparse.to(run.device))).double().cpu()
    ctr = train.label.double().mean().item()
    assert 0.0 < ctr < 0.5  # the shipped sample: a few percent
    assert p.mean().item() == pytest.approx(ctr, rel=1e-5) and p.std().item() < 1e-6


def test_evals_per_epoch_spreads_the_evaluations_over_each_epoch(criteo_sample, tmp_path):
    """train.evals_per_epoch n evaluates every ceil(steps per epoch / n) steps: the sample's 8,000 train rows
    at batch 256 are 32 steps an epoch, so n = 8 evaluates at steps 4, 8, ... 32 (the last one is the
    epoch's end, not evaluated twice)."""
    from dlrm.run.loop import train

    cfg = replace(_tiny(criteo_sample, max_steps=None, epochs=1), "train", evals_per_epoch=8)
    metrics = train(cfg, tmp_path / "run")
    assert metrics["evals"] == 8
    assert [step for step, _ in _scalars(tmp_path / "run", "val/auc")] == list(range(4, 33, 4))
    with pytest.raises(ValueError, match="^train.evals_per_epoch: expected null when train.eval_interval"):
        replace(cfg, "train", eval_interval=5)
