"""Kernel choices made by timing, carried from one process to the next (kernels.gemm.tuning's ChoiceTable,
chosen, use_chosen; dlrm.run.kernel_choices): a process that takes another's record launches what that one
chose and times nothing; a record of another GPU model is not taken; a run's checkpoint carries them and a
resume takes them."""

import pytest
import torch
from loguru import logger

import dlrm.run.loop as train_cli
import kernels.gemm.tuning as gemm_tuning
import kernels.linear_act as linear_act_mod
from dlrm.config import load_config, replace
from dlrm.run import kernel_choices
from tests.conftest import REPO


@pytest.fixture
def fresh(monkeypatch):
    """An empty registry and no preset (a new process), restored after the test."""
    monkeypatch.setattr(gemm_tuning, "_TABLES", {})
    monkeypatch.setattr(gemm_tuning, "_PRESET", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU builds raise


def _timing(monkeypatch, times: dict) -> list:
    timed = []
    monkeypatch.setattr(gemm_tuning, "graph_time", lambda fn: timed.append(fn()) or times[timed[-1]])
    return timed


CANDIDATES = {"a": lambda: "a", "b": lambda: "b"}
KEY = (65536, 512, 256, torch.bfloat16, "tf32", "relu", True)


def test_fastest_times_a_key_once_and_keeps_the_winner(monkeypatch, fresh):
    timed = _timing(monkeypatch, {"a": 2.0, "b": 1.0})
    choices = gemm_tuning.ChoiceTable("forward")
    assert gemm_tuning.fastest(choices, KEY, CANDIDATES) == "b" and choices == {KEY: "b"}
    assert gemm_tuning.fastest(choices, KEY, CANDIDATES) == "b" and timed == ["a", "b"]
    assert gemm_tuning.chosen()["choices"] == {"forward": {repr(KEY): "b"}}


def test_a_taken_record_decides_untimed_and_one_of_another_gpu_is_not_taken(monkeypatch, fresh):
    """The record's choice wins though timing would pick the other (a process that timed apart); a key it
    lacks, or whose choice is no candidate, is timed."""
    timed = _timing(monkeypatch, {"a": 2.0, "b": 1.0})
    record = gemm_tuning.chosen()
    other_key = (128, *KEY[1:])
    record["choices"] = {"forward": {repr(KEY): "a", repr(other_key): "c"}}
    assert not gemm_tuning.use_chosen({**record, "device": "another GPU"})
    assert not gemm_tuning.use_chosen({**record, "triton": "0.0"})
    assert gemm_tuning.use_chosen(record)
    choices = gemm_tuning.ChoiceTable("forward")
    assert gemm_tuning.fastest(choices, KEY, CANDIDATES) == "a" and timed == []
    assert gemm_tuning.fastest(choices, other_key, CANDIDATES) == "b" and timed == ["a", "b"]


def test_choice_tables_have_unique_names(fresh):
    gemm_tuning.ChoiceTable("dW")
    with pytest.raises(ValueError, match="'dW' exists already"):
        gemm_tuning.ChoiceTable("dW")


def test_a_tuned_kernel_launches_a_taken_config_without_the_autotuner(monkeypatch):
    """linear_act's forward kernel (the interpreter's one config): tuned once, its record taken by a
    process that has tuned nothing launches the same config, never entering the autotuner, with the same
    output."""
    monkeypatch.setattr(gemm_tuning, "_PRESET", {})
    monkeypatch.setattr(gemm_tuning, "_TABLES", {})
    kernel = linear_act_mod._linear_act_fwd_kernel
    monkeypatch.setattr(kernel, "_options", gemm_tuning.ChoiceTable("_linear_act_fwd_kernel"))
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g) for shape in ((40, 24), (16, 24), (16,)))
    first = linear_act_mod.triton_fwd(x, w, b, "relu")
    record = gemm_tuning.chosen()
    assert record["choices"]["_linear_act_fwd_kernel"]
    kernel._options.clear()

    class NoAutotuner:
        def __getitem__(self, grid):
            raise AssertionError("the autotuner ran for a key the record holds")

    monkeypatch.setattr(kernel, "autotuner", NoAutotuner())
    assert gemm_tuning.use_chosen(record)
    torch.testing.assert_close(linear_act_mod.triton_fwd(x, w, b, "relu"), first, rtol=0, atol=0)
    assert gemm_tuning.chosen()["choices"] == record["choices"]


@pytest.mark.parametrize("change", ["constexpr_more", "constexpr_fewer"])
def test_a_taken_config_of_another_version_of_the_kernel_is_tuned_anew(monkeypatch, change):
    """A record of another version of the cross forward kernel (a resumed run's) holds a config with a
    constexpr the kernel does not take, or without one it needs: the kernel tunes that key again instead of
    launching a config it cannot run."""
    import kernels.cross as cross

    monkeypatch.setattr(gemm_tuning, "_PRESET", {})
    monkeypatch.setattr(gemm_tuning, "_TABLES", {})
    kernel = cross._cross_fwd_kernel
    monkeypatch.setattr(kernel, "_options", gemm_tuning.ChoiceTable("_cross_fwd_kernel"))
    g = torch.Generator().manual_seed(0)
    x0, xl = torch.randn(40, 24, generator=g), torch.randn(40, 24, generator=g)
    v, u, b = torch.randn(8, 24, generator=g), torch.randn(24, 8, generator=g), torch.randn(24, generator=g)
    first = cross.cross_layer_fwd(x0, xl, v, u, b)
    record = gemm_tuning.chosen()
    ((key, options),) = record["choices"]["_cross_fwd_kernel"].items()
    other = (
        {**options, "EPILOGUE_PIECES": 8} if change == "constexpr_more" else dict(list(options.items())[1:])
    )
    record["choices"]["_cross_fwd_kernel"][key] = other
    kernel._options.clear()
    assert gemm_tuning.use_chosen(record)
    for actual, expected in zip(cross.cross_layer_fwd(x0, xl, v, u, b), first, strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert gemm_tuning.chosen()["choices"]["_cross_fwd_kernel"] == {key: options}  # tuned again


def test_a_checkpoint_carries_the_runs_choices_and_a_resume_takes_them(criteo_sample, tmp_path):
    """A --use-triton run on the CPU (the interpreter tunes linear_act's forward too): last.pt holds one
    record (one rank) with its choices, and the resume says it took them; a record of another GPU model
    is named and timed anew."""
    cfg = load_config(REPO / "configs" / "tiny.json")
    cfg = replace(replace(cfg, "data", path=str(criteo_sample)), "train", use_triton=True, max_steps=2)
    train_cli.train(cfg, tmp_path / "first")
    last = tmp_path / "first" / "checkpoints" / "last.pt"
    records = torch.load(last, weights_only=True)[kernel_choices.KEY]
    assert len(records) == 1 and records[0]["choices"]["_linear_act_fwd_kernel"]
    lines = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    try:
        train_cli.train(replace(cfg, "train", max_steps=3), tmp_path / "first", resume=last)
        kernel_choices.take({kernel_choices.KEY: [{**records[0], "device": "H0"}]}, last, _OneRank())
    finally:
        logger.remove(sink)
    count = sum(len(table) for table in records[0]["choices"].values())
    assert f"kernels: the {count} tuned choices of {last} (its GPU model and Triton)" in lines
    assert f"kernels: timed anew, not taken from {last}: they were timed on H0 with Triton" in "\n".join(
        lines
    )


class _OneRank:
    rank, world_size, is_main = 0, 1, True
