"""docs/architecture.md's module map keeps in step with the source tree: every module and
package has its line, and every line names one that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "narwhal"
MAP = ROOT / "docs" / "architecture.md"

# A row of the module map: "| `router/request.py` | ... |" or "| `router/` | ... |".
ROW = re.compile(r"^\| `([\w/]+(?:\.py|/))` \| (.+) \|$")


def _tree() -> set[str]:
    names = set()
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if path.name == "__init__.py" and relative.parent != Path("."):
            names.add(f"{relative.parent.as_posix()}/")
        else:
            names.add(relative.as_posix())
    return names


def _mapped() -> dict[str, str]:
    rows = {}
    for line in MAP.read_text().splitlines():
        match = ROW.match(line)
        if match:
            rows[match.group(1)] = match.group(2).strip()
    return rows


def test_every_module_and_package_has_a_line_in_the_map() -> None:
    missing = sorted(_tree() - set(_mapped()))
    assert not missing, f"add to docs/architecture.md's module map: {missing}"


def test_every_line_of_the_map_names_a_module_that_exists() -> None:
    stale = sorted(set(_mapped()) - _tree())
    assert not stale, f"docs/architecture.md maps modules that are gone: {stale}"


def test_every_line_says_what_the_module_does() -> None:
    assert all(len(job) > 3 for job in _mapped().values())
