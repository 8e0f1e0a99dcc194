"""`Registry`: name -> class for one kind of pluggable part (eviction / prefetch / miss / routing
policies in `moeflow.policies`, predictors in `moeflow.predict`), chosen by name on the command line."""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Any, TypeVar

from .errors import ConfigError

P = TypeVar("P")

DEFAULT_EVICTION = "next-use"  # `moeflow run`'s and `moeflow simulate`'s eviction: fewest transfers on held-out prompts


class Registry(dict[str, type[Any]]):
    """Name -> class for one kind. `create(name, **options)` builds one, or explains the choices.

    `what` names one entry in messages ("eviction policy", "predictor")."""

    def __init__(self, kind: str, what: str | None = None):
        super().__init__()
        self.kind = kind
        self.what = what or f"{kind} policy"

    def register(self, cls: type[P]) -> type[P]:
        name: str = cls.name  # type: ignore[attr-defined]
        if name in self:
            raise ValueError(f"{self.what} {name!r} registered twice")
        self[name] = cls
        return cls

    def create(self, name: str, opts: Mapping[str, Any] | None = None, /, **options: Any) -> Any:
        """`create("pregate", overfetch=1.5)` or `create(*parse_policy("pregate:overfetch=1.5"))`."""
        options = {**(opts or {}), **options}
        if name not in self:
            raise ConfigError(f"unknown {self.what} {name!r}; choose one of: {', '.join(sorted(self))}")
        cls = self[name]
        try:
            inspect.signature(cls).bind(**options)
        except TypeError:
            accepted = [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
            bad = sorted(set(options) - set(accepted)) or sorted(options)
            raise ConfigError(
                f"{self.what} {name!r} has no option {', '.join(map(repr, bad))}; its options: {', '.join(accepted) or '(none)'}"
            ) from None
        _check_numbers(self.what, name, cls, options)
        try:
            return cls(**options)
        except (TypeError, ValueError) as e:  # a value of the wrong type the signature does not tell
            given = ", ".join(f"{k}={v!r}" for k, v in options.items())
            why = f" ({e})" if isinstance(e, ValueError) else ""  # a TypeError is Python's wording, not the user's
            raise ConfigError(
                f"{self.what} {name!r}: bad option value in {given}{why}; "
                f"give numbers where numbers are expected, e.g. pregate:overfetch=1.5"
            ) from None


_NUMBER = re.compile(r"^(int|float)(\s*\|\s*None)?$|^Optional\[(int|float)\]$")


def _check_numbers(what: str, name: str, cls: type[Any], options: Mapping[str, Any]) -> None:
    """Refuse, in one line, a non-number given to an option the constructor declares a number (`int`, `float`,
    optionally `| None`, or a numeric default): `pregate:overfetch=abc`."""
    for p in inspect.signature(cls).parameters.values():
        if p.name not in options:
            continue
        v = options[p.name]
        ann = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", "")
        numeric = bool(_NUMBER.match(str(ann).strip())) or (
            isinstance(p.default, (int, float)) and not isinstance(p.default, bool)
        )
        if numeric and not (v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))):
            default = isinstance(p.default, (int, float)) and not isinstance(p.default, bool)
            example = f" (its default: {name}:{p.name}={p.default})" if default else ""
            raise ConfigError(f"{what} {name!r}: {p.name}={v!r} is not a number; give a number{example}")
