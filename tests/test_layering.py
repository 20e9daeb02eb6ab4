"""The package layers import only downwards: model <- common <- rollout <- rl.

model/ is the network and its numerics; common/ holds what training and serving share (tokenizers
and the chat template, datasets, math scoring); rollout/ the engines, the server and the base
builders; rl/ the trainer. Every import is checked, module-level and inside functions alike, by
parsing each source file (nothing is imported, so a lazy upward import cannot hide).
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("model", "common", "rollout", "rl")  # each may import itself and those before it


def imported_packages(path: Path) -> set[str]:
    """Top-level package of every `import x` / `from x import y` in the file (relative ones skipped)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def upward_imports(layer: str) -> list[str]:
    above = set(LAYERS[LAYERS.index(layer) + 1 :])
    bad = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        for pkg in sorted(imported_packages(path) & above):
            bad.append(f"{path.relative_to(ROOT)} imports {pkg}")
    return bad


@pytest.mark.parametrize("layer", LAYERS)
def test_layer_imports_nothing_from_the_layers_above(layer):
    assert (ROOT / layer / "__init__.py").exists()
    assert upward_imports(layer) == []


def test_import_checker_sees_imports_inside_functions(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef f():\n    from rl.trainer import Trainer\n    import rollout.engine\n")
    assert imported_packages(src) == {"os", "rl", "rollout"}
