"""The reader under every configuration table: typed getters that name each problem by key path.

A fleet file, an admin API body and every section module (`[controller]`, `[tracing]`, ...)
read their keys through `Table`, so one mistake reads the same wherever it is made and
`narwhal config validate` can list every problem at once rather than stop at the first.
"""

from __future__ import annotations

import difflib
import enum
import json
import math
import re
from collections.abc import Mapping
from typing import Final, TypeGuard, TypeVar

MISSING: Final = object()
_E = TypeVar("_E", bound=enum.StrEnum)
_ENV_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class Problems:
    """The problems found so far, and which key paths they concern.

    Cross-field checks skip keys that already failed, so one mistake is not reported twice
    against a stand-in value.
    """

    def __init__(self) -> None:
        self.messages: list[str] = []
        self._paths: set[str] = set()

    def add(self, path: str, message: str) -> None:
        self.messages.append(f"{path}: {message}")
        self._paths.add(path)

    def failed(self, *prefixes: str) -> bool:
        return any(
            path == prefix or path.startswith((prefix + ".", prefix + "["))
            for path in self._paths
            for prefix in prefixes
        )


class Table:
    """One table of the file: typed getters that record problems and fall back to a stand-in.

    Every key a getter asks for counts as known; `close()` refuses the rest as unknown.
    """

    def __init__(self, problems: Problems, path: str, raw: object) -> None:
        self._problems = problems
        self._path = path
        self._known: list[str] = []
        self._raw: Mapping[object, object] = {}
        if isinstance(raw, Mapping):
            self._raw = raw
        else:
            problems.add(path, f"must be a table, got {show(raw)}")

    @property
    def problems(self) -> Problems:
        return self._problems

    @property
    def where(self) -> str:
        """This table's own key path."""
        return self._path

    def path(self, key: str) -> str:
        return f"{self._path}.{key}" if self._path else key

    def fail(self, key: str, message: str) -> None:
        self._problems.add(self.path(key), message)

    def has(self, key: str) -> bool:
        return key in self._raw

    def take(self, key: str, required: bool) -> object:
        """The raw value, or `MISSING`; a missing required key is a problem."""
        self._known.append(key)
        if key in self._raw:
            return self._raw[key]
        if required:
            self.fail(key, "required key is missing")
        return MISSING

    def integer(self, key: str, default: int | None, low: int, high: int | None = None) -> int:
        """An int in [low, high]; booleans are not integers. A None default makes it required."""
        value = self.take(key, required=default is None)
        fallback = low if default is None else default
        if value is MISSING:
            return fallback
        if is_int(value) and low <= value and (high is None or value <= high):
            return value
        wanted = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"
        self.fail(key, f"must be {wanted}, got {show(value)}")
        return fallback

    def boolean(self, key: str, default: bool) -> bool:
        value = self.take(key, required=False)
        if value is MISSING:
            return default
        if isinstance(value, bool):
            return value
        self.fail(key, f"must be true or false, got {show(value)}")
        return default

    def number(self, key: str, default: float, *, zero_ok: bool = False) -> float:
        """A finite number > 0 (or >= 0); ints are accepted as floats, booleans are not."""
        value = self.take(key, required=False)
        if value is MISSING:
            return default
        bound = ">= 0" if zero_ok else "> 0"
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                number = math.inf
            if not math.isfinite(number):
                self.fail(key, f"must be a finite number {bound}, got {show(value)}")
                return default
            if number > 0 or (zero_ok and number == 0):
                return number
        self.fail(key, f"must be a number {bound}, got {show(value)}")
        return default

    def fraction(self, key: str, default: float) -> float:
        """A number in 0..1; ints 0 and 1 are accepted, booleans are not."""
        value = self.take(key, required=False)
        if value is MISSING:
            return default
        if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= 1:
            return float(value)
        self.fail(key, f"must be a number in 0..1, got {show(value)}")
        return default

    def string(
        self,
        key: str,
        default: str | None,
        *,
        pattern: re.Pattern[str] | None = None,
        wanted: str = "a non-empty string",
    ) -> str:
        """A non-empty string, fully matching `pattern` if given. A None default: required."""
        value = self.take(key, required=default is None)
        fallback = "" if default is None else default
        if value is MISSING:
            return fallback
        if isinstance(value, str) and value and (pattern is None or pattern.fullmatch(value)):
            return value
        self.fail(key, f"must be {wanted}, got {show(value)}")
        return fallback

    def optional_string(self, key: str) -> str | None:
        """A non-empty string, or None when the key is absent."""
        return self.string(key, "") or None

    def optional_integer(self, key: str, low: int) -> int | None:
        """An int >= low, or None when the key is absent."""
        if not self.has(key):
            self.take(key, required=False)
            return None
        return self.integer(key, low, low)

    def failed(self) -> bool:
        """Whether any problem concerns this table or a key in it."""
        return self._problems.failed(self._path)

    def fail_table(self, message: str) -> None:
        """A problem with the table as a whole."""
        self._problems.add(self._path, message)

    def strings(
        self, key: str, *, pattern: re.Pattern[str] | None = None, secret: bool = False
    ) -> tuple[str, ...]:
        """A list of non-empty strings; `secret` keeps the values out of every message."""
        value = self.take(key, required=False)
        if value is MISSING:
            return ()
        spell = withheld if secret else show
        if not isinstance(value, list):
            self.fail(key, f"must be a list of strings, got {spell(value)}")
            return ()
        items: list[str] = []
        for index, item in enumerate(value):
            if isinstance(item, str) and item and (pattern is None or pattern.fullmatch(item)):
                items.append(item)
            else:
                got = show(item) if item == "" else spell(item)
                self.fail(f"{key}[{index}]", f"must be a non-empty string, got {got}")
        return tuple(items)

    def choice(self, key: str, kind: type[_E], default: _E | None) -> _E:
        """One of an enum's values, given as its string. A None default: required."""
        value = self.take(key, required=default is None)
        fallback = next(iter(kind)) if default is None else default
        if value is MISSING:
            return fallback
        for member in kind:
            if isinstance(value, str) and value == member.value:
                return member
        options = ", ".join(f'"{member.value}"' for member in kind)
        self.fail(key, f"must be one of {options}, got {show(value)}")
        return fallback

    def table(self, key: str) -> Table:
        """A sub-table; an absent one reads as empty, so all its keys take their defaults."""
        value = self.take(key, required=False)
        return Table(self._problems, self.path(key), {} if value is MISSING else value)

    def optional_table(self, key: str) -> Table | None:
        """A sub-table whose absence means something; None when absent or not a table."""
        if not self.has(key):
            self.take(key, required=False)
            return None
        table = self.table(key)
        return table if isinstance(self._raw[key], Mapping) else None

    def items(self, key: str, *, required: bool = True) -> list[object] | None:
        """A list (`[[key]]` in TOML); None when absent or not a list."""
        value = self.take(key, required=required)
        if value is MISSING:
            return None
        if not isinstance(value, list):
            self.fail(key, f"must be a list of tables, got {show(value)}")
            return None
        return value

    def rest(self) -> dict[str, object]:
        """The keys no getter asked for, now counted as known."""
        rest = {str(key): value for key, value in self._raw.items() if key not in self._known}
        self._known.extend(rest)
        return rest

    def close(self) -> None:
        """Refuse every key no getter asked for, suggesting the nearest known one."""
        known = list(self._known)
        for key in self.rest():
            near = difflib.get_close_matches(key, known, n=1)
            self.fail(key, "unknown key" + (f' (did you mean "{near[0]}"?)' if near else ""))


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def show(value: object) -> str:
    """A value as the file would spell it, cut short when long."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, int | float):
        text = repr(value)
    elif isinstance(value, str | list | dict) or value is None:
        text = json.dumps(value, ensure_ascii=False, default=str)
    else:
        text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def withheld(value: object) -> str:
    """What a value is, without what it says: it may be a credential."""
    if isinstance(value, str):
        return f"a string of {len(value)} characters (value withheld)"
    kind = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        list: "a list",
        dict: "a table",
    }
    return f"{kind.get(type(value), 'a ' + type(value).__name__)} (value withheld)"


def env_name(table: Table, key: str) -> str | None:
    """The name of an environment variable; a bad one is withheld, as it may be the secret."""
    value = table.take(key, required=False)
    if value is MISSING:
        return None
    if isinstance(value, str) and _ENV_NAME.fullmatch(value):
        return value
    table.fail(
        key,
        "must be the name of an environment variable (letters, digits and _, not starting "
        f"with a digit), got {withheld(value)}",
    )
    return None
