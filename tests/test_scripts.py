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
