"""The tests mirror the source, so that a module's tests are where its name says and a test
file's name cannot drift from the code it tests.

- `tests/<package>/.../test_<module>.py` tests `src/narwhal/<package>/.../<module>.py`; a
  second file on the same module adds an aspect to the name, `test_<module>_<aspect>.py`
  (`tests/protocol/test_sse_fuzz.py`, `tests/engines/test_http_bulk.py`);
- `tests/benchmarks/test_<module>.py` tests `benchmarks/<module>.py` the same way;
- a test file imports from the package it sits in (the benchmark module, for a benchmark's),
  itself or through the support modules it imports (tests/support/legs.py builds the request
  path's parts for tests/router/);
- the directories of `WHOLE_SYSTEM` test the system as a whole rather than one module and
  are left out, and the files of `PROJECT_WIDE` sit in tests/ itself, reading the whole
  source tree;
- support code is the package tests/support/ and holds no tests; elsewhere a Python file
  is a test file, a `conftest.py` or an `__init__.py`;
- every directory of tests is a package, so that same-named files of two directories
  (tests/config/test_placement.py, tests/fleet/test_placement.py) are two modules to mypy and
  to pytest; all but tests/http, since tests/ is on `sys.path` and a package named `http`
  there would hide the standard library's.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
SOURCE = ROOT / "src" / "narwhal"
BENCHMARKS = ROOT / "benchmarks"

WHOLE_SYSTEM = {
    "e2e": "the whole router over real sockets, with simulated or scripted engines",
    "real": "the router in front of real vLLM engines on the CPU",
    "deploy": "the deploy files: the image, the Helm chart, the dashboards and alert rules",
    "docs": "the documentation: every fleet file it shows validates",
}
NO_TESTS = {
    "support": "support code for the tests",
    "data": "recordings and fleet files the tests read",
}
PROJECT_WIDE = {
    "test_architecture.py": "docs/architecture.md's module map against the tree",
    "test_imports.py": "the import graph of all of src/narwhal",
    "test_layout.py": "this file: where every test file is",
}
NOT_PACKAGES = {TESTS / "http"}
TOP_FILES = {"conftest.py"}


def python_files() -> list[Path]:
    return sorted(
        path
        for path in TESTS.rglob("*.py")
        if not any(part.startswith((".", "__pycache__")) for part in path.relative_to(TESTS).parts)
    )


def module_tests() -> list[Path]:
    """The test files that test one module: under tests/<package>/, outside the whole-system
    directories and those without tests."""
    return [
        path
        for path in python_files()
        if path.name.startswith("test_")
        and len(path.relative_to(TESTS).parts) > 1
        and path.relative_to(TESTS).parts[0] not in WHOLE_SYSTEM.keys() | NO_TESTS.keys()
    ]


def mirrored(test: Path) -> tuple[Path, str | None]:
    """The source directory a test file mirrors, and the module of it that the file names
    (the longest one whose name the file's starts with), if any."""
    relative = test.relative_to(TESTS)
    if relative.parts[0] == "benchmarks":
        directory = BENCHMARKS.joinpath(*relative.parts[1:-1])
    else:
        directory = SOURCE.joinpath(*relative.parts[:-1])
    named = test.stem.removeprefix("test_")
    modules = sorted(
        (
            source.stem
            for source in directory.glob("*.py")
            if source.stem != "__init__"
            and (named == source.stem or named.startswith(source.stem + "_"))
        ),
        key=len,
    )
    return directory, modules[-1] if modules else None


def imported(path: Path) -> set[str]:
    """Every module a file imports (`from a import b` counts as `a` and `a.b`), anywhere in it."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def reached(test: Path) -> set[str]:
    """The modules a test file imports, itself or through the support modules it imports."""
    names = imported(test)
    for name in sorted(names):
        support = TESTS.joinpath(*name.split(".")).with_suffix(".py")
        if name.startswith("support.") and support.is_file():
            names |= imported(support)
    return names


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_every_module_test_names_an_existing_module() -> None:
    tests = module_tests()
    assert tests
    wrong = []
    for test in tests:
        directory, module = mirrored(test)
        if module is None:
            name = test.stem.removeprefix("test_")
            wrong.append(f"{shown(test)}: no {shown(directory / name)}.py (nor a shorter name)")
    assert wrong == []


def test_a_module_test_imports_from_the_package_it_sits_in() -> None:
    wrong = []
    for test in module_tests():
        relative = test.relative_to(TESTS)
        if relative.parts[0] == "benchmarks":
            _, module = mirrored(test)
            wanted = {module} if module else set()
            ok = bool(wanted & reached(test))
        else:
            package = ".".join(("narwhal", *relative.parts[:-1]))
            ok = any(name == package or name.startswith(package + ".") for name in reached(test))
        if not ok:
            wrong.append(shown(test))
    assert wrong == []


def test_the_top_of_tests_holds_only_project_wide_tests() -> None:
    top = {path.name for path in TESTS.glob("*.py")}
    assert top - PROJECT_WIDE.keys() - TOP_FILES == set()


def test_outside_support_a_python_file_is_a_test_a_conftest_or_a_package() -> None:
    support = TESTS / "support"
    stray = [
        shown(path)
        for path in python_files()
        if support not in path.parents
        and not path.name.startswith("test_")
        and path.name not in {"conftest.py", "__init__.py"}
    ]
    assert stray == []


def test_support_holds_no_tests() -> None:
    tests = []
    for path in (TESTS / "support").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and (
                node.name.startswith(("test_", "Test"))
            ):
                tests.append(f"{shown(path)}: {node.name}")
        if path.name.startswith("test_"):
            tests.append(shown(path))
    assert tests == []


def test_every_test_directory_is_a_package_but_http() -> None:
    directories = {path.parent for path in python_files() if path.parent != TESTS}
    assert directories >= NOT_PACKAGES
    wrong = [
        shown(directory)
        for directory in sorted(directories)
        if (directory / "__init__.py").exists() == (directory in NOT_PACKAGES)
    ]
    assert wrong == []
