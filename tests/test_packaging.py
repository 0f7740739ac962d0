"""What a bare ``pip install`` of nnrt gives: every module nnrt imports is
the package's own, the standard library's, or a distribution that
pyproject.toml's ``dependencies`` declare (test extras do not count: an app
never installs them); the public submodules are there after ``import nnrt``."""
import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Imported only where the app itself brought the module: trio, when the app
# runs on trio (sniffio says so).
THE_APPS_OWN = {"trio"}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_top_levels() -> dict[str, str]:
    """Top-level module imported -> the first nnrt file importing it."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "nnrt").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def test_every_import_of_nnrt_is_a_declared_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_normal(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0])
                for d in project["dependencies"]}
    distributions = importlib.metadata.packages_distributions()
    undeclared = []
    for module, where in _imported_top_levels().items():
        if module == "nnrt" or module in sys.stdlib_module_names or module in THE_APPS_OWN:
            continue
        dists = {_normal(d) for d in distributions.get(module, [module])}
        if not dists & declared:
            undeclared.append(f"{module} ({where}; distribution {', '.join(sorted(dists))})")
    assert not undeclared, "imported but not in pyproject.toml's dependencies: " + \
        "; ".join(undeclared)


def test_public_submodules_are_reachable_after_import_nnrt_alone():
    code = ("import sys, nnrt\n"
            "assert 'nnrt.tflite' not in sys.modules, 'import nnrt pays for the TFLite reader'\n"
            "model = nnrt.tflite.load(sys.argv[1])\n"
            "print(type(model).__name__, nnrt.qos.Policy.__name__)\n")
    model = ROOT.parent / "shared" / "models" / "generated" / "mobilenet_v1_0.25_128_float32.tflite"
    out = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["Model", "Policy"]


def test_a_driver_service_does_not_load_the_runtime():
    """The runtime's names are loaded on first use: a driver service (and
    any process that imports a part of nnrt without running apps) starts
    without it -- about 0.2 s of every service's start."""
    code = ("import sys, nnrt.cli, nnrt.service.server\n"
            "assert 'nnrt.runtime' not in sys.modules, sorted(m for m in sys.modules\n"
            "    if m.startswith('nnrt.runtime'))\n"
            "import nnrt\n"
            "assert 'Runtime' in dir(nnrt) and nnrt.Runtime.__name__ == 'Runtime'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
