"""Command-line strings -> values, one implementation each for every command:

- `parse_value("1.5")`: an option value -> int, float, bool, None or the string itself;
- `parse_opts(["k=v", ...])` / `opts_dict(pairs)`: repeatable `key=value` flags -> checked pairs -> typed kwargs;
- `parse_policy("pregate:overfetch=1.5,lookahead=2")`: `name[:key=value,...]` -> (name, typed kwargs);
- `parse_capacity("25%", total_experts=..., expert_bytes=...)`: a cache size (experts, percent of all
  routed experts, or bytes) -> experts; `check_capacity_syntax` checks one before a model is known;
- `split_list(["lru,lfu", "fld"])`: repeated flags and comma lists -> values (policy options kept together);
- `policy_args` / `build_policy`: a policy string plus `--eviction-opt/--prefetch-opt` pairs -> (name,
  kwargs) -> a built policy (one line for any bad name, option or value).
Keys use `_` for `-` (`right-farthest=1` -> `right_farthest`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from ..errors import ConfigError

_BYTES = re.compile(r"^(?P<n>[0-9]*\.?[0-9]+)\s*(?P<u>[kKmMgGtT]i?[bB])$")
_UNITS = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_value(v: str) -> Any:
    """'none'/'null' -> None, 'true'/'false' -> bool, then int, then float, else the string."""
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


def _key(k: str) -> str:
    return k.strip().replace("-", "_")


def parse_opts(items: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """['overfetch=1.5', ...] -> (('overfetch', '1.5'), ...); ConfigError for an item without '='."""
    out = []
    for it in items:
        if "=" not in it:
            raise ConfigError(f"option {it!r} must look like key=value")
        k, v = it.split("=", 1)
        out.append((_key(k), v.strip()))
    return tuple(out)


def opts_dict(opts: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """key=value pairs -> typed kwargs (`parse_value`)."""
    return {k: parse_value(v) for k, v in opts}


def parse_policy(text: str) -> tuple[str, dict[str, Any]]:
    """'pregate:overfetch=1.5,lookahead=2' -> ('pregate', {'overfetch': 1.5, 'lookahead': 2})."""
    name, _, rest = text.strip().partition(":")
    opts: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        k, eq, v = part.partition("=")
        if not eq or not k.strip():
            raise ConfigError(f"policy option {part!r} in {text!r} is not key=value (e.g. pregate:overfetch=1.5)")
        opts[_key(k)] = parse_value(v.strip())
    if not name:
        raise ConfigError(f"empty policy name in {text!r}")
    return name, opts


def parse_capacity(spec: str, *, total_experts: int, expert_bytes: int | None, flag: str = "--capacity") -> int:
    """`N` experts, `P%` of all routed experts (rounded, at least 1), or a byte size (`64MB`, `1.5GiB`;
    needs `expert_bytes`) -> experts. `flag` names the option in error messages."""
    s = str(spec).strip()
    try:
        if s.endswith("%"):
            p = float(s[:-1])
            if not 0 < p <= 100:
                raise ConfigError(f"{flag} {spec!r}: a percentage must be in (0, 100]")
            return max(1, round(total_experts * p / 100))
        if s.isdigit():
            return int(s)
        m = _BYTES.match(s)
        if m and expert_bytes:
            u = m["u"].lower()
            mult = _UNITS[u[0]] if "i" not in u else 1024 ** ("kmgt".index(u[0]) + 1)
            return int(float(m["n"]) * mult) // expert_bytes
    except ValueError:
        pass
    raise ConfigError(f"{flag} {spec!r} not understood; use experts (48), a percentage (25%) or a size (64MB, 1.5GiB)")


def split_list(values: str | list[str] | tuple[str, ...] | None, flag: str | None = None) -> tuple[str, ...]:
    """Repeated flags and comma lists -> values: `["lru,lfu", "fld"]` -> `("lru", "lfu", "fld")`.

    A piece `key=value` without a `:` continues the policy before it, so
    `pregate:overfetch=1.5,mass=0.9,lru` -> `("pregate:overfetch=1.5,mass=0.9", "lru")`. With `flag` (the
    option's name), a flag given with nothing in it (`-e ''`, `-c ,`) is refused: it is not the default."""
    if values is None:
        return ()
    items = [values] if isinstance(values, str) else list(values)
    out: list[str] = []
    for item in items:
        for piece in (p.strip() for p in item.split(",")):
            if not piece:
                continue
            if "=" in piece and ":" not in piece and out and ":" in out[-1]:
                out[-1] += "," + piece
            else:
                out.append(piece)
    if flag is not None and not out and items:
        raise ConfigError(f"{flag} {' '.join(items)!r} names nothing; give a value or drop {flag}")
    return tuple(out)


def policy_args(text: str, opts: tuple[tuple[str, str], ...] = ()) -> tuple[str, dict[str, Any]]:
    """`name[:k=v,...]` plus the `--eviction-opt/--prefetch-opt key=value` pairs -> (name, typed options);
    inline options win over the flag's."""
    name, inline = parse_policy(text)
    return name, {**opts_dict(opts), **inline}


def build_policy(registry: Any, text: str, opts: tuple[tuple[str, str], ...] = ()) -> Any:
    """The policy `text` (`name[:k=v,...]`, plus `opts`) from `registry`: one line for an unknown name,
    an unknown option or a bad option value (`pregate:overfetch=abc`)."""
    name, kw = policy_args(text, opts)
    try:
        return registry.create(name, **kw)
    except ConfigError as e:
        import inspect

        head = str(e).split(";")[0]
        others = {p for n in registry for p in inspect.signature(registry[n]).parameters}  # options some policy takes
        flagged = [k for k in sorted(set(opts_dict(opts)) - set(parse_policy(text)[1])) if f"'{k}'" in head and k in others]
        if "has no option" not in head or not flagged:
            raise
        # a --X-opt pair goes to every policy of the kind; one meant for another of them goes inline
        k = flagged[0]
        raise ConfigError(f"{e} (--{registry.kind}-opt applies to every {registry.kind} policy given; for one only, "
                          f"write it inline: NAME:{k}=...)") from None  # fmt: skip


def check_capacity_syntax(spec: str) -> None:
    """Refuse a capacity that no model could turn into experts (`abc`, `0`, `150%`); the model-dependent
    bounds (at least top-k, at most all experts) are checked once the model is loaded."""
    n = parse_capacity(spec, total_experts=1 << 40, expert_bytes=1)
    if n < 1:
        raise ConfigError(f"--capacity {spec!r} gives no expert slot; use at least top-k experts (e.g. 8 or 25%)")
