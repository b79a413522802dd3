"""`[server] workers` and `--workers`: a count, or `auto` for the cores the process may use."""

from __future__ import annotations

import os
from typing import Any

import pytest

from narwhal.config.root import ConfigError, parse_config
from narwhal.config.workers import conflict, parse_workers_flag, quota_cores, resolve_workers

ENGINES = [
    {"id": "p", "url": "http://10.0.0.1:1", "role": "prefill"},
    {"id": "d", "url": "http://10.0.0.2:1", "role": "decode"},
]


def with_server(**server: Any) -> dict[str, Any]:
    return {"model": "m", "server": server, "engines": ENGINES}


def test_one_worker_by_default() -> None:
    assert parse_config({"model": "m", "engines": ENGINES}).server.workers == 1


def test_a_count_or_auto_is_read() -> None:
    assert parse_config(with_server(workers=4)).server.workers == 4
    assert parse_config(with_server(workers="auto")).server.workers == "auto"


@pytest.mark.parametrize("bad", [0, -1, 257, "four", True, 2.5])
def test_anything_else_is_named_by_its_path(bad: object) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(with_server(workers=bad))
    (problem,) = caught.value.problems
    assert problem.startswith("server.workers: ")


def test_auto_is_the_cores_this_process_may_use() -> None:
    assert 1 <= resolve_workers("auto") <= len(os.sched_getaffinity(0))
    assert resolve_workers(3) == 3


def test_a_cpu_quota_caps_auto_rounded_up() -> None:
    assert quota_cores("max 100000\n") is None
    assert quota_cores("200000 100000\n") == 2
    assert quota_cores("150000 100000") == 2
    assert quota_cores("50000 100000") == 1


def test_the_flag_takes_the_files_values() -> None:
    assert parse_workers_flag("auto") == "auto"
    assert parse_workers_flag("2") == 2
    with pytest.raises(ValueError):
        parse_workers_flag("0")


def test_the_role_controller_runs_in_one_process_only() -> None:
    assert conflict(1, controller_enabled=True) is None
    assert conflict(2, controller_enabled=False) is None
    message = conflict(2, controller_enabled=True)
    assert message is not None and "server.workers = 1" in message
