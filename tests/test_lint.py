"""The code base passes `ruff check` with the project's settings (pyproject.toml [tool.ruff]: pycodestyle and pyflakes,
lines of at most 120 columns)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "selfspec", "tests"], cwd=ROOT, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stdout + run.stderr
