"""The import graph runs one way, checked with ``ast`` over every module
(imports inside functions included, so a lazy import cannot hide an arrow that
runs backwards). From the bottom:

0. the library (``rlgate.*``): pure logic, no Ray actor classes;
1. the Ray actor layer, ``rlgate.actors`` (the checkout's top-level ``actors/``);
2. the composition modules that put actors together: ``rlgate.serving.app``
   (the Serve application) and ``rlgate.training.driver`` (the training run);
3. the command line, ``rlgate.cli``;
4. a checkout's thin entry points, ``serve_app.py`` and ``train_driver.py``.

A module may import its own layer or a lower one. Nothing imports the
top-level name ``actors``: the layer is installed, and imported, as
``rlgate.actors``."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import ROOT

COMPOSITION = {"rlgate.serving.app", "rlgate.training.driver"}
ENTRY_POINTS = {"serve_app", "train_driver"}


def layer(module: str) -> int:
    if module in ENTRY_POINTS:
        return 4
    if module == "rlgate.cli" or module.startswith("rlgate.cli."):
        return 3
    if module in COMPOSITION:
        return 2
    if module == "rlgate.actors" or module.startswith("rlgate.actors."):
        return 1
    return 0


def imports(path: Path) -> set[str]:
    """The absolute module names ``path`` imports (``from a import b`` counts ``a.b``
    as well, since ``b`` may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def modules() -> dict[str, Path]:
    """Every module of ours by its import name."""
    found = {"serve_app": ROOT / "serve_app.py", "train_driver": ROOT / "train_driver.py"}
    for path in (ROOT / "rlgate").rglob("*.py"):  # not through the rlgate/actors link: that is next
        found[".".join(("rlgate", *path.relative_to(ROOT / "rlgate").with_suffix("").parts))] = path
    for path in (ROOT / "actors").glob("*.py"):
        found[f"rlgate.actors.{path.stem}"] = path
    return {name.removesuffix(".__init__"): path for name, path in found.items()}


def backward_arrows() -> set[tuple[str, str]]:
    ours = modules()
    arrows = set()
    for name, path in ours.items():
        for target in imports(path):
            if target == "actors" or target.startswith("actors."):
                arrows.add((name, target))  # the layer by its checkout folder's name
            elif target in ours and layer(target) > layer(name):
                arrows.add((name, target))
    return arrows


def test_no_import_runs_backwards_across_the_layers():
    assert backward_arrows() == set(), "imports against the layers"


def test_the_layers_are_where_the_docs_say():
    ours = modules()
    actor_layer = {name for name in ours if layer(name) == 1}
    assert actor_layer == {f"rlgate.actors.{p.stem}" for p in (ROOT / "actors").glob("*.py")} - {
        "rlgate.actors.__init__"
    } | {"rlgate.actors"}
    assert (ROOT / "rlgate" / "actors").resolve() == (ROOT / "actors").resolve()  # one folder, two names
    assert COMPOSITION | ENTRY_POINTS <= ours.keys()


def test_the_check_sees_lazy_and_backward_imports(tmp_path, monkeypatch):
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from rlgate.actors.gateway import Gateway\n    import train_driver\n")
    assert imports(module) == {"rlgate.actors.gateway", "rlgate.actors.gateway.Gateway", "train_driver"}
    library = tmp_path / "pure.py"
    library.write_text("from rlgate.training import driver\nimport actors.capacity\n")
    monkeypatch.setattr(f"{__name__}.modules", lambda: {"rlgate.pure": library, "rlgate.training.driver": library})
    assert backward_arrows() == {
        ("rlgate.pure", "rlgate.training.driver"),
        ("rlgate.pure", "actors.capacity"),
        ("rlgate.training.driver", "actors.capacity"),
    }
