"""The process environment, read here and nowhere else in Narwhal.

Everything else gets what it needs from these functions: the credentials the config names
(`config.secrets`), the admin key `narwhal top` falls back on, and the environment a child
process inherits.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# `narwhal top --admin-key` when the flag is not given.
ADMIN_KEY = "NARWHAL_ADMIN_KEY"


def process_environment() -> Mapping[str, str]:
    """This process's environment variables, as they are when read."""
    return os.environ


def admin_key() -> str | None:
    """The admin key in NARWHAL_ADMIN_KEY, or None when it is unset."""
    return os.environ.get(ADMIN_KEY)


def child_environment(overrides: Mapping[str, str]) -> dict[str, str]:
    """The environment for a child process: this one's (PATH, locale), then `overrides`."""
    return {**os.environ, **overrides}
