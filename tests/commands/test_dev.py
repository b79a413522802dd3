"""`narwhal dev` from a source checkout: it finds the tree that can build real vLLM."""

from __future__ import annotations

from pathlib import Path

from narwhal.commands.dev import _checkout

ROOT = Path(__file__).resolve().parents[2]


def test_the_checkout_is_the_source_tree_the_package_runs_from() -> None:
    assert _checkout() == ROOT
