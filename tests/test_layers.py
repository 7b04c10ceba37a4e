"""Imports run one way: common <- data <- model <- training <- launch <- train.py.

Every import statement is read, the ones inside functions too: a lower layer never imports a higher one.
"""

from __future__ import annotations

import ast

import pytest

from tests.conftest import REPO

LAYERS = ("common", "data", "model", "training", "launch", "train")


def _imports(path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("layer", LAYERS[:-1])
def test_no_layer_imports_a_higher_one(layer):
    files = sorted((REPO / layer).rglob("*.py"))
    assert files, layer
    rank = LAYERS.index(layer)
    upward = [
        f"{f.relative_to(REPO)}:{line} imports {name}"
        for f in files
        for line, name in _imports(f)
        if name.split(".")[0] in LAYERS and LAYERS.index(name.split(".")[0]) > rank
    ]
    assert not upward, upward
