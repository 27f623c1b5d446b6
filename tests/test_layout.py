"""The test suites' layout: no test module imports another. What two test modules share
lives in a module of its own (e2e/harness/, tests/fakekube.py, tests/fakeoperator.py)
or a conftest.py. Reads the sources only."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITES = ("tests", "e2e")


def suite_modules(root: Path) -> dict[str, Path]:
    """Every test module (test_*.py) under the suites' folders, by dotted name."""
    return {".".join(p.relative_to(root).with_suffix("").parts): p
            for suite in SUITES for p in sorted((root / suite).rglob("test_*.py"))}


def imported_names(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The modules an import statement may load: for `from X import a`, X and X.a
    (`a` may be a submodule); relative imports resolved against `package`."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join([*parts, *([base] if base else [])])
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def cross_imports(root: Path) -> list[str]:
    """"file:line: statement" for each import of a test module by a test module."""
    modules = suite_modules(root)
    found = []
    for name, path in modules.items():
        package = name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            if any(n in modules for n in imported_names(node, package)):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_test_module_imports_another() -> None:
    modules = suite_modules(ROOT)
    assert {name.split(".")[0] for name in modules} == set(SUITES)  # both suites read
    offending = cross_imports(ROOT)
    assert not offending, ("test modules import other test modules; move what they share "
                           "into e2e/harness/, tests/conftest.py or a tests/fake*.py module:\n"
                           + "\n".join(offending))


def test_the_check_names_each_offending_file_and_import(tmp_path: Path) -> None:
    sources = {
        "tests/conftest.py": "from tests.fakekube import FakeKube\n",
        "tests/fakekube.py": "",
        "tests/test_a.py": ("from aiohttp.test_utils import TestServer\n"
                            "from tests.conftest import aio\n"
                            "from tests.fakekube import FakeKube\n"
                            "from tests.test_b import helper\n"),
        "tests/test_b.py": "import tests.test_a\n",
        "e2e/harness/__init__.py": "",
        "e2e/harness/waits.py": "",
        "e2e/test_c.py": "from e2e.harness.waits import eventually\n",
        "e2e/kind/test_d.py": ("from e2e import test_c as c\n"
                               "def f() -> None:\n"
                               "    from ..test_c import x\n"
                               "from . import conftest\n"),
        "e2e/kind/conftest.py": "",
    }
    for rel, text in sources.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert sorted(cross_imports(tmp_path)) == [
        "e2e/kind/test_d.py:1: from e2e import test_c as c",
        "e2e/kind/test_d.py:3: from ..test_c import x",
        "tests/test_a.py:4: from tests.test_b import helper",
        "tests/test_b.py:1: import tests.test_a",
    ]
