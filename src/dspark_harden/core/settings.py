"""Strict settings: every environment variable the plugin reads is declared and parsed here.

Features declare their variables as :class:`Setting` objects (through the ``dspark_settings``
hook); :func:`load_settings` parses them all at once and raises :class:`SettingsError` naming
*every* variable with a bad value. Nothing else in the package reads ``os.environ`` for its own
configuration.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional


class SettingsError(ValueError):
    """One or more environment variables hold invalid values."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid dspark-harden settings: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------
# parsers: each takes the raw string and returns the typed value or raises ValueError(reason)


def flag01(raw: str) -> bool:
    """exactly "0" or "1" (no true/yes/on: a hardening switch must be unambiguous)"""
    if raw == "1":
        return True
    if raw == "0":
        return False
    raise ValueError(f"must be exactly '0' or '1', got {raw!r}")


def _int(raw: str, expected: str) -> int:
    try:
        return int(raw.strip(), 10)
    except ValueError:
        raise ValueError(f"must be {expected}, got {raw!r}") from None


def positive_int(raw: str) -> int:
    value = _int(raw, "a positive integer")
    if value <= 0:
        raise ValueError(f"must be a positive integer, got {raw!r}")
    return value


def int_range(lo: int, hi: int) -> Callable[[str], int]:
    """An integer in [lo, hi]."""

    def parse(raw: str) -> int:
        value = _int(raw, f"an integer in [{lo}, {hi}]")
        if not lo <= value <= hi:
            raise ValueError(f"must be an integer in [{lo}, {hi}], got {raw!r}")
        return value

    parse.__doc__ = f"integer in [{lo}, {hi}]"
    parse.bad_examples = ("", str(lo - 1), str(hi + 1), "1.5", "abc")
    return parse


def nonneg_int(raw: str) -> int:
    value = _int(raw, "a non-negative integer")
    if value < 0:
        raise ValueError(f"must be a non-negative integer, got {raw!r}")
    return value


def positive_float(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError(f"must be a positive number, got {raw!r}") from None
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"must be a positive finite number, got {raw!r}")
    return value


def nonneg_float(raw: str) -> float:
    """a number >= 0"""
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError(f"must be a number >= 0, got {raw!r}") from None
    if not (value >= 0 and value != float("inf")):
        raise ValueError(f"must be a finite number >= 0, got {raw!r}")
    return value


def nonempty_str(raw: str) -> str:
    if not raw.strip():
        raise ValueError("must not be empty")
    return raw


def choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}; got {raw!r}")
        return raw

    parse.__doc__ = "one of: " + ", ".join(allowed)
    parse.bad_examples = ("", "bogus", allowed[0].upper() + "x")
    return parse


def name_list(raw: str) -> tuple[str, ...]:
    """Comma-separated non-empty names (whitespace around names ignored)."""
    items = tuple(part.strip() for part in raw.split(","))
    if any(not item for item in items):
        raise ValueError(f"must be a comma-separated list of non-empty names, got {raw!r}")
    return items


def directory_path(raw: str) -> str:
    if not raw.strip():
        raise ValueError("must be a non-empty path")
    return os.path.abspath(os.path.expanduser(raw))


# Values each parser must reject (used by the test that feeds every bad value to every variable).
flag01.bad_examples = ("", "true", "yes", "2", " 1", "on")
positive_int.bad_examples = ("", "0", "-1", "1.5", "abc", "1e3")
nonneg_int.bad_examples = ("", "-1", "1.5", "abc")
positive_float.bad_examples = ("", "0", "-1", "nan", "inf", "abc")
nonneg_float.bad_examples = ("", "-1", "-0.5", "nan", "inf", "abc")
nonempty_str.bad_examples = ("", "   ")
name_list.bad_examples = ("", ",", "a,,b", " , ")
directory_path.bad_examples = ("", "  ")


def bad_examples(parse: Callable[[str], Any]) -> tuple:
    """Values ``parse`` must reject; every parser used by a Setting declares them."""
    return tuple(getattr(parse, "bad_examples", ()))


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One environment variable: its parser, default (already typed) and what it does."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    feature: Optional[str] = None
    # Human-readable form of the accepted values, for `dspark-harden env` and docs/.
    accepts: str = ""

    def describe_accepts(self) -> str:
        if self.accepts:
            return self.accepts
        return (self.parse.__doc__ or self.parse.__name__).strip().splitlines()[0]


@dataclass
class Settings:
    """Parsed values of every declared variable."""

    values: dict[str, Any]
    explicit: set[str] = field(default_factory=set)
    specs: dict[str, Setting] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        if name not in self.values:
            raise KeyError(f"setting {name} is not declared by any dspark-harden feature")
        return self.values[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)

    def is_explicit(self, name: str) -> bool:
        return name in self.explicit


def load_settings(specs: Iterable[Setting], environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Parse every declared variable; raise one :class:`SettingsError` listing all bad values."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    explicit: set[str] = set()
    by_name: dict[str, Setting] = {}
    problems: list[str] = []
    for spec in specs:
        if spec.name in by_name:
            problems.append(f"{spec.name} is declared twice (features {by_name[spec.name].feature} and {spec.feature})")
            continue
        by_name[spec.name] = spec
        raw = env.get(spec.name)
        if raw is None:
            values[spec.name] = spec.default
            continue
        try:
            values[spec.name] = spec.parse(raw)
        except ValueError as exc:
            problems.append(f"{spec.name} {exc}")
            continue
        explicit.add(spec.name)
    if problems:
        raise SettingsError(problems)
    return Settings(values=values, explicit=explicit, specs=by_name)


# Core settings (features add their own through the ``dspark_settings`` hook).
CORE_SETTINGS = [
    Setting(
        "DSPARK_HARDEN_ALLOW_DRIFT",
        name_list,
        (),
        "Comma-separated patch targets (or the single word 'all') allowed to bind although the stock "
        "source no longer matches the fingerprint the patch was written against. Every use is logged "
        "at WARNING. Leave unset in production.",
        accepts="comma-separated targets, or 'all'",
    ),
    Setting(
        "DSPARK_HARDEN_ROLE",
        choice("main", "controller", "scheduler", "detokenizer"),
        None,
        "Role for a process SGLang did not start (`dspark-harden check` children). In a process SGLang "
        "started, the role comes from the caller of load_plugins() and a disagreeing value stops startup "
        "(never leave it exported in a server's environment).",
    ),
    Setting(
        "DSPARK_HARDEN_STRICT_EXTENSIONS",
        flag01,
        True,
        "1: a third-party feature (entry-point group dspark_harden.features) that fails to import "
        "stops startup. 0: it is skipped with an ERROR log (not recommended).",
    ),
]
