"""The command line from a source checkout: `narwhal bench` finds its harness there."""

from __future__ import annotations

import pytest

from narwhal.commands import cli


def test_bench_finds_its_harness_in_the_checkout(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        cli.main(["bench", "--help"])
    out = capsys.readouterr()
    assert ended.value.code == 0, out.err
    assert "--shape" in out.out
