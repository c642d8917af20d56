"""What ``pip install`` puts on a machine: ``rlgate`` alone, its Ray actor layer
inside it as ``rlgate.actors``, and everything a job needs importable with no
checkout around (the JobManager runs ``python -m rlgate.training.driver``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

from tests.support import ROOT


def test_a_wheel_holds_rlgate_alone_and_runs_from_anywhere(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "actors", source / "actors", ignore=ignore)
    shutil.copytree(ROOT / "rlgate", source / "rlgate", symlinks=True, ignore=ignore)  # rlgate/actors stays a link
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(source),
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = tmp_path.glob("rlgate-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")} == {"rlgate"}
    actors = {name.removeprefix("rlgate/actors/") for name in names if name.startswith("rlgate/actors/")}
    assert actors == {path.name for path in (ROOT / "actors").glob("*.py")}

    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    elsewhere = tmp_path / "elsewhere"  # no checkout: not the cwd, not on the path
    elsewhere.mkdir()
    probe = (
        "import rlgate.actors.job_manager, rlgate.serving.app, rlgate.training.driver, rlgate.cli.main\n"
        "print(rlgate.actors.job_manager.__file__)"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=elsewhere,
        env={**os.environ, "PYTHONPATH": str(unpacked)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert found.returncode == 0, found.stderr[-3000:]
    assert found.stdout.strip() == str(unpacked / "rlgate" / "actors" / "job_manager.py")
    help_text = subprocess.run(
        [sys.executable, "-m", "rlgate.training.driver", "--help"],
        cwd=elsewhere,
        env={**os.environ, "PYTHONPATH": str(unpacked)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert help_text.returncode == 0 and "--job-manager" in help_text.stdout, help_text.stderr[-3000:]
