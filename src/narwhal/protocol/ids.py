"""Request ids: 128 random bits as 32 hex digits, the form `uuid4().hex` has.

They name requests (to clients, engines and the journal); they are not secrets. So they
come from a generator seeded once per process by the OS, instead of a system call for
each id as `uuid4()` makes.
"""

from __future__ import annotations

import os
import random

_random = random.Random(os.urandom(32))


def _reseed() -> None:
    # A forked process must not repeat its parent's ids.
    _random.seed(os.urandom(32))


os.register_at_fork(after_in_child=_reseed)


def new_id() -> str:
    """A fresh id: 32 lowercase hex digits."""
    return f"{_random.getrandbits(128):032x}"
