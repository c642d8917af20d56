"""The code passes the project's linter and formatter (ruff; settings in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_and_format():
    ruff = [sys.executable, "-m", "ruff"]
    check = subprocess.run([*ruff, "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    formatted = subprocess.run([*ruff, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert formatted.returncode == 0, formatted.stdout + formatted.stderr
