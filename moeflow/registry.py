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
DEFAULT_MISS = "fetch"  # every command's miss policy: copy the missing expert in


def host_miss(row: Mapping[str, Any]) -> bool:
    """Whether a `simulate` or `tune` result row sends its misses to the host (`miss` other than the default fetch):
    such a row copies no missed expert, so a hit rate of 0 means no miss and the bound of copies does not apply."""
    return row.get("miss", DEFAULT_MISS) != DEFAULT_MISS


_P = "moeflow.policies."

# The built-in policies: kind -> name -> "module:Class", in the order --help lists them. The CLI's help reads the
# names from here, importing no policy (they import torch and numba); `moeflow.policies` registers the classes,
# `Registry.register` refuses a moeflow class not listed here, and tests/test_cli_startup.py checks that the
# registries hold exactly these classes.
BUILTIN: dict[str, dict[str, str]] = {
    "eviction": {
        "lru": _P + "eviction:LRU",
        "lfu": _P + "eviction:LFU",
        "lhu": _P + "eviction:LHU",
        "fld": _P + "eviction:FLD",
        "score": _P + "eviction:ScoreBased",
        "lru2": _P + "eviction:TwoLevelLRU",
        "belady-approx": _P + "belady_approx:BeladyApprox",
        "least-stale": _P + "least_stale:LeastStale",
        "next-use": _P + "next_use:NextUse",
    },
    "prefetch": {
        "none": _P + "prefetch:NoPrefetch",
        "pregate": _P + "prefetch:PreGatePrefetch",
        "all-next-layer": _P + "prefetch:AllNextLayer",
        "router-pf": _P + "learned:RouterPFPrefetch",
        "estimator": _P + "learned:EstimatorPrefetch",
        "hybrid": _P + "learned:HybridPrefetch",
        "token-id": _P + "learned:TokenIdPrefetch",
        "forest": _P + "learned:ForestPrefetch",
    },
    "miss": {
        "fetch": _P + "miss:Fetch",
        "drop": _P + "miss:Drop",
        "substitute": _P + "miss:Substitute",
        "cpu": _P + "miss:Cpu",
        "auto": _P + "miss:Auto",
        "fetch-lowest-bit": _P + "miss:FetchLowestBit",
        "fetch-priority": _P + "miss:FetchPriority",
        "cascade": _P + "miss:Cascade",
    },
    "routing": {
        "standard": _P + "routing:Standard",
        "cache-aware": _P + "routing:CacheAware",
        "hit-first": _P + "routing:HitFirst",
        "plan-restricted": _P + "routing:PlanRestricted",
    },
}

# The built-in prefetchers that need a `moeflow train` predictor folder (--prefetch-opt predictors=DIR): the ones
# that declare `needs_model`, `needs_residual` or a `predictor`.
LEARNED_PREFETCH = frozenset({"router-pf", "estimator", "hybrid", "token-id", "forest"})


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
        where = f"{cls.__module__}:{cls.__qualname__}"
        if self.kind in BUILTIN and cls.__module__.startswith("moeflow.") and BUILTIN[self.kind].get(name) != where:
            raise ValueError(f"built-in {self.what} {name!r} ({where}) is not in moeflow.registry.BUILTIN[{self.kind!r}]")
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
            if isinstance(e, ValueError) and str(e) and not _PY_CONVERSION.match(str(e)):  # the policy's own words
                raise ConfigError(f"{self.what} {name!r}: bad option value in {given} ({e})") from None
            raise ConfigError(  # a TypeError, or int()/float() of a word: Python's wording, not the user's
                f"{self.what} {name!r}: bad option value in {given}; "
                f"give numbers where numbers are expected, e.g. pregate:overfetch=1.5"
            ) from None


_PY_CONVERSION = re.compile(r"invalid literal for |could not convert ")  # int('x') / float('x')
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
