"""The package's import graph points down: kernels -> ops -> layers -> models -> tasks / inference / data.

Every module under ``elsa_vision/`` is parsed with ``ast`` (nothing is imported or run) and every import in it
-- module level or inside a function, absolute or relative -- is resolved to the ``elsa_vision`` module it
names. The rules:

* ``elsa_vision.kernels`` imports nothing from ``ops``, ``distributed``, ``partial_attention``, ``layers``,
  ``models``, ``tasks``, ``inference``, ``data``;
* ``elsa_vision.ops`` nothing from ``distributed`` or ``partial_attention`` (context parallelism and its
  building blocks, built on ``ops``), ``layers``, ``models``, ``tasks``, ``inference``, ``data``;
* ``elsa_vision.layers`` nothing from ``models``, ``tasks``, ``inference``, ``data``;
* ``elsa_vision.models`` nothing from ``tasks``, ``inference``, ``data``;
* ``elsa_vision.patching`` (the user-facing ``patch_attention`` / ``sdpa_override``, a walk over
  ``layers``) is imported by no module of the package except the package ``__init__``; scripts and tests
  may import it.

A rule broken is reported with the file, the line and the imported module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "elsa_vision"

# layer -> the packages it must not import from
FORBIDDEN = {
    "kernels": ("ops", "distributed", "partial_attention", "layers", "models", "tasks", "inference", "data"),
    "ops": ("distributed", "partial_attention", "layers", "models", "tasks", "inference", "data"),
    "layers": ("models", "tasks", "inference", "data"),
    "models": ("tasks", "inference", "data"),
}
PATCHING = f"{PACKAGE}.patching"
PATCHING_IMPORTERS = {PACKAGE}  # the package __init__


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """``(line, module)`` for every import of ``path`` that names an ``elsa_vision`` module: ``X`` for
    ``import X`` and ``from X import a``, except ``from elsa_vision import a`` (relative or absolute), where
    ``a`` is the module named."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == PACKAGE:  # from elsa_vision import models: the names are the modules
                found += [(node.lineno, f"{target}.{a.name}") for a in node.names if a.name != "*"]
            else:
                found.append((node.lineno, target))
    return [(line, m) for line, m in found if m == PACKAGE or m.startswith(PACKAGE + ".")]


def violations(root: Path = ROOT) -> list[str]:
    out = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        name = module_name(path, root)
        layer = name.split(".")[1] if name.count(".") else ""
        rel = path.relative_to(root)
        for line, target in imported_modules(path, root):
            sub = target.split(".")[1] if target.count(".") else ""
            if sub in FORBIDDEN.get(layer, ()):
                out.append(f"{rel}:{line}: {PACKAGE}.{layer} imports {target}")
            if (target == PATCHING or target.startswith(PATCHING + ".")) and name not in PATCHING_IMPORTERS:
                out.append(f"{rel}:{line}: {name} imports {PATCHING}")
    return sorted(set(out))


def test_imports_point_down():
    assert violations() == []


@pytest.mark.parametrize("where, source, expected", [
    ("layers", "from ..models import vit\n", "elsa_vision.layers imports elsa_vision.models"),
    ("layers", "from ..inference.highres import build_model\n",
     "elsa_vision.layers imports elsa_vision.inference.highres"),
    ("kernels", "import elsa_vision.ops.attention\n",
     "elsa_vision.kernels imports elsa_vision.ops.attention"),
    ("ops", "from elsa_vision import layers\n", "elsa_vision.ops imports elsa_vision.layers"),
    ("ops", "from ..partial_attention import partial_attention\n",
     "elsa_vision.ops imports elsa_vision.partial_attention"),
    ("models", "def f():\n    from elsa_vision.patching import patch_attention\n",
     "elsa_vision.models.probe imports elsa_vision.patching"),
    ("models", "from .. import patching\n", "elsa_vision.models.probe imports elsa_vision.patching"),
])
def test_a_broken_rule_is_reported(tmp_path, where, source, expected):
    """The check itself: an upward import written into a module of a layer (also inside a function, relative
    or absolute, or through ``from .. import``) is found, once."""
    layer = tmp_path / PACKAGE / where
    layer.mkdir(parents=True)
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (layer / "__init__.py").write_text("")
    (layer / "probe.py").write_text(source)
    found = violations(tmp_path)
    assert len(found) == 1 and found[0].endswith(expected), found
