"""The tree shows the layers (DESIGN.md, "Layout"): imports point down only, the speculation core
never reaches llama.cpp, and the controller names no proposer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "homespec"

# package -> top-level names it must not import (its own layer and those above it)
FORBIDDEN = {
    "speculation": ("llama_cpp", "homespec.llama", "homespec.models", "homespec.serving", "homespec.cli",
                    "homespec.dashboard", "homespec.mtp", "torch"),
    "llama": ("homespec.speculation", "homespec.models", "homespec.serving", "homespec.cli", "homespec.dashboard"),
    "models": ("homespec.speculation", "homespec.serving", "homespec.cli", "homespec.dashboard"),
    "serving": ("homespec.cli", "homespec.dashboard"),
    "dashboard": ("llama_cpp", "homespec.llama", "homespec.speculation", "homespec.models", "homespec.cli"),
}


def imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_down_only(package):
    bad = [
        f"{path.relative_to(PKG.parent)} imports {mod}"
        for path in sorted((PKG / package).rglob("*.py"))
        for mod in sorted(imports(path))
        if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN[package])
    ]
    assert not bad, "\n".join(bad)


def test_the_controller_names_no_proposer():
    source = (PKG / "speculation" / "controller.py").read_text()
    names = {"ngram", "draft", "mtp"}
    literals = {n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert not names & literals
    assert "proposers.ngram" not in source and "proposers.draft" not in source and "proposers.mtp" not in source
