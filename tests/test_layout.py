"""The package's layout: layers that import downwards only (import-linter's contracts in pyproject.toml) and
no private name (a leading underscore) taken from another module."""

import ast
import pathlib

from .utils import run_python

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_layers_point_down():
    # Every import counts, those inside functions too: an upward one is a cycle waiting to happen.
    from importlinter.cli import lint_imports  # the test extra; imported here so `pytest -m gpu` collects without it

    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0


def _private_crossings(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in modules):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_private_name_crosses_a_module():
    # What two modules share is public in the lower one.
    crossings = {str(p.relative_to(ROOT)): c for p in sorted((ROOT / "flashlite").rglob("*.py"))
                 if (c := _private_crossings(p))}
    assert not crossings, crossings


def test_private_crossing_is_detected(tmp_path):
    # The check itself can fail.
    bad = tmp_path / "bad.py"
    bad.write_text("from .core.runtime import _hidden\nfrom . import tiles\ntiles._load()\n")
    assert len(_private_crossings(bad)) == 2


def test_integrations_reachable_from_the_package():
    # The README's `import flashlite; flashlite.integrations.transformers.register()`: the submodule resolves on
    # first access, and `import flashlite` itself leaves transformers unimported.
    code = (
        "import sys\n"
        "import flashlite\n"
        "assert 'transformers' not in sys.modules, 'import flashlite imported transformers'\n"
        "hook = flashlite.integrations.transformers\n"
        "assert hook.NAME == 'fl_attention' and callable(hook.register)\n"
        "print('ok')\n"
    )
    done = run_python("-c", code)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
