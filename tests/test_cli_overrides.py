"""`--set KEY=VALUE` and the `--no-...` side of the flags on the commands that read a config: the run that
the command starts gets the config file with the overrides, and a bad override is one line, exit 2."""

import json

import pytest
from click.testing import CliRunner

from dlrm import finetune
from dlrm import train as train_cli
from dlrm.checkpoint import save_checkpoint
from dlrm.config import RunConfig
from tests.conftest import REPO

TINY = REPO / "configs" / "tiny.json"


@pytest.fixture
def started(monkeypatch) -> list[RunConfig]:
    """The configs of the runs that the commands start (the runs themselves are not started)."""
    configs = []

    def record(cfg, *args, **kwargs):
        configs.append(cfg)
        return {}

    monkeypatch.setattr(train_cli, "train", record)
    monkeypatch.setattr(finetune, "train", record)
    return configs


def test_train_applies_set_then_its_own_flags(started):
    args = ["--config", str(TINY), "--set", "train.lr=0.05", "--set", "model.embedding_dim=4",
            "--set", "model.bottom_mlp=[8, 4]", "--set", "train.seed=1", "--seed", "2"]  # fmt: skip
    result = CliRunner().invoke(train_cli.main, args)
    assert result.exit_code == 0, result.output
    (cfg,) = started
    assert (cfg.train.lr, cfg.model.embedding_dim, cfg.model.bottom_mlp) == (0.05, 4, (8, 4))
    assert cfg.train.seed == 2  # the flag, after --set


@pytest.mark.parametrize("key", ["use_triton", "use_torch_compile", "cuda_graphs"])
def test_no_flags_turn_off_what_the_config_turns_on(started, tmp_path, key):
    raw = json.loads(TINY.read_text())
    raw["train"].update(use_triton=True, use_torch_compile=True, cuda_graphs=True)
    config = tmp_path / "on.json"
    config.write_text(json.dumps(raw))
    off = {"use_triton": ["--no-use-triton", "--no-cuda-graphs"]}.get(key, [f"--no-{key.replace('_', '-')}"])
    result = CliRunner().invoke(train_cli.main, ["--config", str(config), *off])
    assert result.exit_code == 0, result.output
    assert getattr(started[0].train, key) is False
    result = CliRunner().invoke(train_cli.main, ["--config", str(config)])  # unset: the config's value
    assert result.exit_code == 0, result.output
    assert getattr(started[1].train, key) is True


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "train.lr=fast"], "error: --set train.lr=fast: train.lr: expected a number, got 'fast'"),
        (["--set", "train.rate=1"], "error: --set train.rate=1: train.rate: unknown key (train has "),
        (["--set", "lr"], "error: --set lr: expected KEY=VALUE"),
    ],
)
def test_bad_set_is_one_line_and_exit_2(started, args, message):
    result = CliRunner().invoke(train_cli.main, ["--config", str(TINY), *args])
    assert result.exit_code == 2 and not started
    assert result.output.startswith(message) and result.output.count("\n") == 1


def test_resume_command_repeats_each_set():
    args = ["--config", "c.json", "--set", "train.lr=0.05", "--set", 'model.attention={"heads": 4}',
            "--no-use-triton"]  # fmt: skip
    command = train_cli.resume_command(train_cli.main.make_context("train", args), REPO / "last.pt")
    expected = "--config c.json --set train.lr=0.05 --set 'model.attention={\"heads\": 4}' --no-use-triton"
    assert command.endswith(f"{expected} --resume {REPO}/last.pt")


def test_finetune_applies_set_and_no_use_triton(started, tmp_path):
    base = RunConfig()
    checkpoint = tmp_path / "base.pt"
    save_checkpoint(checkpoint, model={}, config=base.to_dict(), table_rows=[3] * 26)
    args = ["--checkpoint", str(checkpoint), "--lora-rank", "2", "--set", "train.lr=0.01",
            "--set", "train.use_triton=true", "--no-use-triton"]  # fmt: skip
    result = CliRunner().invoke(finetune.main, args)
    assert result.exit_code == 0, result.output
    (cfg,) = started
    assert (cfg.train.lr, cfg.train.use_triton, cfg.model.lora.rank) == (0.01, False, 2)
    # A model key the checkpoint was not trained with: refused, naming the key.
    result = CliRunner().invoke(finetune.main, [*args, "--set", "model.max_rows=5"])
    assert result.exit_code == 2 and "model.max_rows" in result.output and len(started) == 1
