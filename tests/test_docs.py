"""Every code block of README.md and docs/guide/ runs as written.

A page's ``python`` blocks run in order in one fresh interpreter (a later
block may use what an earlier one defined, as a reader following the page
would), with the checkout as the working directory. Each ``sh`` block runs on
its own as a bash script (``set -euo pipefail``) with the checkout's venv first
on PATH; whatever it left running in the background is killed when it ends.
A ``make TARGET`` line is checked with ``make -n TARGET`` (the target exists
and resolves) rather than run: ``make demo`` is run by
tests/integration/test_demo.py and ``make test`` is this suite itself.
Blocks of any other language (``text`` output, ``toml`` policy files) are
shown, not run.
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
TIMEOUT = 300.0

pytestmark = pytest.mark.slow


def blocks(page: Path) -> list[tuple[str, int, str]]:
    """(language, first line number, code) of each fenced block of a page."""
    text = page.read_text()
    return [(m.group(1), text.count("\n", 0, m.start(2)) + 1, m.group(2))
            for m in FENCE.finditer(text)]


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("NNRT_DRIVERS", None)       # a page names the services it starts
    return env


def _run(argv: list[str], what: str, stdin: str = "") -> None:
    """Run ``argv`` in a session of its own until it exits, then kill what it
    left in the background. Output goes to a file, not a pipe: a background
    job still holding a pipe open would keep a reader waiting."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdin=subprocess.PIPE, stdout=out,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            proc.communicate(stdin, timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        log = out.read()[-4000:]
    assert proc.returncode is not None and proc.returncode >= 0, \
        f"{what} still ran after {TIMEOUT:.0f} s:\n{log}"
    assert proc.returncode == 0, f"{what} failed (exit {proc.returncode}):\n{log}"


# Runs a page's python blocks in order in one namespace; a failure names the
# block's line in the page.
RUNNER = textwrap.dedent("""
    import sys, json
    page, blocks = sys.argv[1], json.loads(sys.stdin.read())
    namespace = {"__name__": "__main__"}
    for line, code in blocks:
        code = "\\n" * (line - 1) + code     # tracebacks give the page's line numbers
        exec(compile(code, page, "exec"), namespace)
""")


def _python(page: Path, found: list[tuple[str, int, str]]) -> None:
    import json
    code = [(line, text) for lang, line, text in found if lang == "python"]
    if code:
        _run([sys.executable, "-c", RUNNER, str(page.relative_to(ROOT))],
             f"{page.name}'s python blocks", stdin=json.dumps(code))


def _shell(page: Path, line: int, code: str) -> None:
    script = re.sub(r"^(\s*)make\s+([\w.-]+)\s*(#.*)?$", r"\1make -n \2 >/dev/null",
                    code, flags=re.M)
    _run(["bash", "-c", "set -euo pipefail\n" + script], f"{page.name}, sh block at line {line}")


SHELLS = ("sh", "bash", "shell", "console")


def _runs() -> list:
    """One run per page for its python blocks (they share a namespace, in
    order), one per shell block (each its own shell): separate tests, so the
    suite's workers share a long page."""
    runs = []
    for page in PAGES:
        found = blocks(page)
        name = str(page.relative_to(ROOT))
        if any(lang == "python" for lang, _, _ in found):
            runs.append(pytest.param(page, None, id=f"{name}:python"))
        runs += [pytest.param(page, line, id=f"{name}:sh@{line}")
                 for lang, line, _ in found if lang in SHELLS]
    return runs


@pytest.mark.parametrize("page,line", _runs())
def test_every_code_block_of_the_page_runs(page, line):
    found = blocks(page)
    if line is None:
        _python(page, found)
    else:
        _shell(page, line, next(code for lang, at, code in found if at == line))


def test_the_guide_exists_and_its_pages_have_code():
    """A page of the guide without a single runnable block is a page whose
    examples no test holds to the API."""
    guide = PAGES[1:]
    assert guide, "docs/guide/ has no pages"
    for page in guide:
        assert any(lang in ("python", "sh") for lang, _, _ in blocks(page)), page.name
