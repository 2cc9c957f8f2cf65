"""What the ops and layers share has one home, read from the source with ``ast`` (nothing is imported):

* no module imports a private name (``_x``) of another module: a helper two modules need is public in a
  neutral home (``ops.checks``, ``ops.numerics``, ``ops._library`` ...), not borrowed from one of them;
* the accumulation rule (float64 inputs computed in float64, everything else in float32) is written once,
  in ``kernels/precision.py`` (``accumulation_dtype``), below every module that needs it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_layering import PACKAGE, ROOT, module_name


def _modules(root: Path = ROOT):
    for path in sorted((root / PACKAGE).rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _is_module(root: Path, dotted: str) -> bool:
    base = root.joinpath(*dotted.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def private_imports(root: Path = ROOT) -> list[str]:
    """``file:line: name from module`` for every ``from <elsa_vision module> import _name`` where ``_name`` is
    not itself a module."""
    out = []
    for path, tree in _modules(root):
        name = module_name(path, root)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not (target == PACKAGE or target.startswith(PACKAGE + ".")):
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and not _is_module(root, f"{target}.{alias.name}"):
                    out.append(f"{path.relative_to(root)}:{node.lineno}: {alias.name} from {target}")
    return out


def _float64_else_float32(node: ast.AST) -> bool:
    def dtype(n, which):
        return isinstance(n, ast.Attribute) and n.attr == which
    return isinstance(node, ast.IfExp) and dtype(node.body, "float64") and dtype(node.orelse, "float32")


def accumulation_rules(root: Path = ROOT) -> list[str]:
    return [f"{path.relative_to(root)}:{node.lineno}" for path, tree in _modules(root)
            for node in ast.walk(tree) if _float64_else_float32(node)]


def test_no_module_imports_a_private_name_of_another():
    assert private_imports() == []


def test_the_accumulation_rule_is_written_once():
    found = accumulation_rules()
    assert len(found) == 1 and found[0].startswith(f"{PACKAGE}/kernels/precision.py:"), found


@pytest.mark.parametrize("source, expected", [
    ("from .attention import _shape\n", ["_shape from elsa_vision.ops.attention"]),
    ("from elsa_vision.ops.attention import _shape, elsa_attention\n",
     ["_shape from elsa_vision.ops.attention"]),
    ("def f():\n    from ..kernels.fwd import _cdiv\n", ["_cdiv from elsa_vision.kernels.fwd"]),
    ("from ._library import define_op\nfrom . import _library\n", []),  # a private module is no private name
])
def test_a_private_import_is_reported(tmp_path, source, expected):
    ops = tmp_path / PACKAGE / "ops"
    ops.mkdir(parents=True)
    for f in (tmp_path / PACKAGE / "__init__.py", ops / "__init__.py", ops / "_library.py"):
        f.write_text("")
    (ops / "probe.py").write_text(source)
    assert [line.split(": ", 1)[1] for line in private_imports(tmp_path)] == expected


def test_a_second_accumulation_rule_is_reported(tmp_path):
    ops = tmp_path / PACKAGE / "ops"
    ops.mkdir(parents=True)
    (ops / "probe.py").write_text(
        "import torch\nacc = torch.float64 if x.dtype == torch.float64 else torch.float32\n")
    assert accumulation_rules(tmp_path) == [f"{PACKAGE}/ops/probe.py:2"]
