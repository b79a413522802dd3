"""Every fleet file the documentation shows validates with the project's own parser.

What is checked:

- every fenced block opened with ```toml in README.md and docs/*.md, indented fences
  (inside a list) included. Every such block in these pages is fleet-file content: TOML
  that is not (a pyproject excerpt, say) must be fenced with another language, such as
  ```text, to be left alone;
- every file under examples/ whose name ends in .toml.

How: the TOML is read with `tomllib` and validated with `narwhal.config.root.parse_config`,
which checks a parsed mapping by the same rules `load_config` applies to a file.

- A block with a top-level `model` key is a whole fleet file and is validated exactly as
  written. So is every example file.
- A block without one is a fragment (say `[slo]` alone, or `[controller]` with the one
  engine it is about) and is laid over `MINIMAL`, a fleet of one prefill and one decode
  engine: the fragment's tables are added to it, and its `[[engines]]` entries are
  appended to MINIMAL's two. A fragment may name those two engines (`prefill-0`,
  `decode-0`), as `[placement] kv_events` must, and must not reuse their ids or urls.

Each block is one test case, named by file and the line of its opening fence
(`docs/operations.md:48`); each example file by its path.
"""

from __future__ import annotations

import copy
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from narwhal.config.root import ConfigError, parse_config

ROOT = Path(__file__).resolve().parents[2]

MINIMAL: dict[str, Any] = {
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "engines": [
        {"id": "prefill-0", "url": "http://10.0.0.7:8100", "role": "prefill"},
        {"id": "decode-0", "url": "http://10.0.0.8:8200", "role": "decode"},
    ],
}

# An opening fence: its indent, its run of backticks or tildes, and its info string.
_OPENING = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*?)\s*$")


@dataclass(frozen=True, slots=True)
class Snippet:
    """One fleet file or fragment: where it is, its TOML text, and whether it is a page's."""

    where: str
    text: str
    in_page: bool

    def fleet(self) -> dict[str, Any]:
        """What `parse_config` is given: the file, or the fragment laid over MINIMAL."""
        data = tomllib.loads(self.text)
        return on_minimal(data) if self.is_fragment(data) else data

    def is_fragment(self, data: dict[str, Any]) -> bool:
        return self.in_page and "model" not in data


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(page: Path) -> list[tuple[int, str]]:
    """The ```toml blocks of a Markdown page: each opening fence's line and the text."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[tuple[int, str]] = []
    index = 0
    while index < len(lines):
        opening = _OPENING.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        language = opening["info"].split(maxsplit=1)[0].lower() if opening["info"] else ""
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        start = index + 1  # the opening fence's line, counted from 1
        body: list[str] = []
        index += 1
        while index < len(lines) and not closing.match(lines[index]):
            line = lines[index]
            strip = len(line) - len(line.lstrip(" "))
            body.append(line[min(strip, indent) :])
            index += 1
        if language == "toml":
            blocks.append((start, "\n".join(body) + "\n"))
        index += 1  # past the closing fence
    return blocks


def _collect() -> list[Snippet]:
    snippets: list[Snippet] = []
    for page in _pages():
        name = page.relative_to(ROOT).as_posix()
        snippets.extend(Snippet(f"{name}:{line}", text, True) for line, text in _blocks(page))
    for path in sorted((ROOT / "examples").rglob("*.toml")):
        name = path.relative_to(ROOT).as_posix()
        snippets.append(Snippet(name, path.read_text(encoding="utf-8"), False))
    return snippets


def on_minimal(fragment: dict[str, Any]) -> dict[str, Any]:
    """The minimal fleet with a fragment's tables added and its engines appended."""
    data = copy.deepcopy(MINIMAL)
    for key, value in fragment.items():
        if key == "engines" and isinstance(value, list):
            data["engines"].extend(value)
        else:
            data[key] = value
    return data


SNIPPETS = _collect()


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.where for s in SNIPPETS])
def test_snippet_validates(snippet: Snippet) -> None:
    problem: str | None = None
    try:
        parse_config(snippet.fleet(), source=snippet.where)
    except tomllib.TOMLDecodeError as error:
        problem = f"{snippet.where}: invalid TOML: {error}"
    except ConfigError as error:
        fragment = snippet.is_fragment(tomllib.loads(snippet.text))
        kind = "a fragment laid over the minimal fleet" if fragment else "a whole fleet file"
        problem = f"{kind}:\n{error.report()}"
    if problem is not None:
        pytest.fail(problem, pytrace=False)


def test_snippets_are_found() -> None:
    """The finder works: the README's fleet file and the commented example are both here."""
    found = {s.where.partition(":")[0] for s in SNIPPETS}
    assert {"README.md", "examples/fleet.toml"} <= found
    kinds: dict[str, bool] = {}  # where -> is a fragment; invalid TOML fails its own case
    for snippet in SNIPPETS:
        try:
            kinds[snippet.where] = snippet.is_fragment(tomllib.loads(snippet.text))
        except tomllib.TOMLDecodeError:
            continue
    assert any(w.startswith("README.md:") and not frag for w, frag in kinds.items())
    assert any(kinds.values()), "no fragment found: the merge rule is untested"


def test_blocks_reads_indented_fences_and_skips_other_languages(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n"
        "\n"
        "```text\n"
        "model = 'not toml to check'\n"
        "```\n"
        "\n"
        "- a list item:\n"
        "\n"
        "  ```toml\n"
        "  [slo]\n"
        "  ttft_s = 1.0\n"
        "  ```\n"
        "\n"
        "````toml\n"
        "model = 'm'\n"
        "```\n"
        "````\n",
        encoding="utf-8",
    )
    assert _blocks(page) == [(9, "[slo]\nttft_s = 1.0\n"), (14, "model = 'm'\n```\n")]
