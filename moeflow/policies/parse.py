"""`name[:key=value,...]` policy strings from the command line -> (name, options)."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError


def _value(v: str) -> Any:
    low = v.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def parse_policy(text: str) -> tuple[str, dict[str, Any]]:
    """'pregate:overfetch=1.5,lookahead=2' -> ('pregate', {'overfetch': 1.5, 'lookahead': 2})."""
    name, _, rest = text.strip().partition(":")
    opts: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        k, eq, v = part.partition("=")
        if not eq or not k.strip():
            raise ConfigError(f"policy option {part!r} in {text!r} is not key=value (e.g. pregate:overfetch=1.5)")
        opts[k.strip().replace("-", "_")] = _value(v.strip())
    if not name:
        raise ConfigError(f"empty policy name in {text!r}")
    return name, opts


def create(registry: Any, text: str) -> Any:
    """Build a policy from a `name[:k=v,...]` string with `registry` (EVICTION, PREFETCH, ...)."""
    name, opts = parse_policy(text)
    return registry.create(name, **opts)
