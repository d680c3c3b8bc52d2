"""Nothing silently wrong: a checkpoint carries the sha256 of its bytes, and every CLI that reads one
refuses a changed copy with one line naming the file; nothing is written."""

import pytest
import torch

from dlrm import checkpoint
from dlrm import evaluate as evaluate_cli
from dlrm import export as export_cli
from dlrm import finetune as finetune_cli
from dlrm import predict as predict_cli
from dlrm import train as train_cli
from tests.test_faults import _cli, _config, _one_error_line, trained  # noqa: F401 - trained: a fixture


@pytest.fixture
def flipped(trained, tmp_path):  # noqa: F811
    """A copy of the trained run's last.pt with 64 bytes in its middle inverted."""
    data = bytearray((trained / "checkpoints" / "last.pt").read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    bad = tmp_path / "flipped.pt"
    bad.write_bytes(bytes(data))
    return bad


def test_a_saved_checkpoint_carries_the_sha256_of_its_bytes(trained):  # noqa: F811
    path = trained / "checkpoints" / "last.pt"
    assert checkpoint.verify_checksum(path)
    assert torch.load(path, weights_only=True)["step"] == 4  # plain torch.load reads past the trailer


@pytest.mark.parametrize("cli", ["evaluate", "predict", "export", "finetune", "resume"])
def test_every_reader_refuses_a_changed_checkpoint_with_one_line(criteo_sample, flipped, tmp_path, cli):
    out = tmp_path / "out"
    main, args = {
        "evaluate": (evaluate_cli.main, ["--checkpoint", flipped, "--data", criteo_sample]),
        "predict": (
            predict_cli.main,
            ["--checkpoint", flipped, "--input", criteo_sample, "--output", out / "p.parquet"],
        ),
        "export": (export_cli.main, ["--checkpoint", flipped, "--output", out / "m.pt2"]),
        "finetune": (finetune_cli.main, ["--checkpoint", flipped, "--merge", "--output", out / "m.pt"]),
        "resume": (
            train_cli.main,
            ["--config", _config(tmp_path, criteo_sample), "--resume", flipped, "--output-dir", out],
        ),
    }[cli]
    code, output = _cli(main, args)
    line = _one_error_line(output)
    assert code == 2 and line.startswith(f"error: {flipped}: checksum mismatch"), line
    assert not out.exists()


def test_a_checkpoint_without_a_checksum_loads(trained, tmp_path):  # noqa: F811
    data = (trained / "checkpoints" / "last.pt").read_bytes()
    old = tmp_path / "old.pt"
    old.write_bytes(data[: -checkpoint.TRAILER_BYTES])  # as written before checkpoints carried one
    assert not checkpoint.verify_checksum(old)
    assert checkpoint.load_checkpoint(old)["step"] == 4


def test_a_truncated_checkpoint_is_one_line_not_cut_mid_word(criteo_sample, trained, tmp_path):  # noqa: F811
    data = (trained / "checkpoints" / "last.pt").read_bytes()
    bad = tmp_path / "cut.pt"
    bad.write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError) as raised:
        checkpoint.load_checkpoint(bad)
    message = str(raised.value)
    assert message.startswith(f"{bad}: not a readable checkpoint") and "\n" not in message
    reason = message.split("RuntimeError: ", 1)[1]
    assert len(reason) <= 124 and reason.endswith(" ..."), message  # cut at a word, and says so
