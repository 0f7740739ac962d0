"""The import graph keeps the layers of DESIGN.md: fmq imports nothing of
nnrt, drivers never import the runtime, ops and model.types sit below the
drivers, nothing imports upward."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "nnrt"

# package -> packages of nnrt it must never import
FORBIDDEN = {
    "fmq": {"model", "ops", "drivers", "runtime", "burst", "fence", "qos", "memory", "testing"},
    "model": {"drivers", "runtime", "burst", "fence", "testing"},
    "ops": {"drivers", "runtime", "burst", "fence", "testing"},
    "drivers": {"runtime", "testing"},
    "qos": {"drivers", "runtime", "testing"},
    "fence": {"runtime", "testing"},
    "memory": {"model", "ops", "drivers", "runtime", "burst", "fence", "qos", "testing"},
    # The importer builds models through the public builder only, so it works
    # with any runtime and driver.
    "tflite": {"drivers", "runtime", "burst", "fence", "qos", "memory", "testing"},
}


def _imports(path: Path) -> set[str]:
    """nnrt subpackages a module imports (absolute or relative)."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(ROOT).parts
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(rel[:-1])[: len(rel) - node.level]
                target = base + (node.module.split(".") if node.module else [])
                if not target and node.names:
                    target = [node.names[0].name]
                if target:
                    found.add(target[0])
            elif node.module and node.module.startswith("nnrt."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nnrt."):
                    found.add(alias.name.split(".")[1])
    return found


def test_no_upward_imports():
    problems = []
    for package, forbidden in FORBIDDEN.items():
        for path in (ROOT / package).rglob("*.py"):
            bad = _imports(path) & forbidden
            if bad:
                problems.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not problems, problems


def test_ops_use_only_the_model_types_and_graph():
    for path in (ROOT / "ops").rglob("*.py"):
        text = path.read_text()
        assert "model.validate" not in text and "model.builder" not in text, path
