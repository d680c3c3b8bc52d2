"""Every command-line script under scripts/ imports and prints its --help (they need a GPU to run, so CI
would not otherwise notice an import that a refactoring broke)."""

import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPTS = sorted(p for p in (REPO / "scripts").glob("*.py") if "@click.command" in p.read_text())


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_help(script):
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0 and "Usage:" in result.stdout, result.stderr


def test_model_layout(monkeypatch):
    """bench_kernels.model_layout hands the interaction's output width (367 fp32, 479 bf16) over in rows of 16
    bytes, as the dot interaction writes it, with the same values; the dense features and aligned widths as
    they are."""
    import torch

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    from bench_kernels import model_layout

    for k, dtype, stride in ((367, torch.float32, 368), (479, torch.bfloat16, 480)):
        x = torch.randn(5, k).to(dtype)
        padded = model_layout(x)
        assert padded.stride() == (stride, 1)
        assert torch.equal(padded, x)
    for x in (torch.randn(5, 13), torch.randn(5, 512)):
        assert model_layout(x) is x
