"""Request ids have uuid4().hex's form and do not repeat, in a process or across a fork."""

from __future__ import annotations

import os
import re

from narwhal.protocol.ids import new_id


def test_an_id_is_32_lowercase_hex_digits() -> None:
    assert all(re.fullmatch(r"[0-9a-f]{32}", new_id()) for _ in range(1000))


def test_ids_do_not_repeat() -> None:
    assert len({new_id() for _ in range(100_000)}) == 100_000


def test_a_forked_process_draws_other_ids_than_its_parent() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, new_id().encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    assert re.fullmatch(r"[0-9a-f]{32}", child)
    assert child != new_id()
