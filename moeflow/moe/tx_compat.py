"""The one place moeflow touches transformers' private MoE internals, checked against a tested range.

The offload engine computes the experts exactly as transformers' `grouped_mm` implementation does,
on its own slot buffer, and plugs itself in as an experts implementation. For that it needs
private parts of `transformers.integrations.moe` that may change in any release:
- `_grouped_linear(input [S,in], weight [G,out,in] (or [G,in,out] transposed), offs [G] int32,
  bias=[S,out] | None, is_transposed=False) -> [S,out]`: rows offs[g-1]:offs[g] use weight g;
- `_batched_linear(input [S,in], weight [S,out,in] (or [S,in,out]), bias=[S,out] | None, is_transposed)`, the
  `batched_mm` implementation's kernel, which transformers' `generate` uses for the decode stage of a `grouped_mm`
  model off the CPU (`decode_batched`; optional: without it the engine keeps its grouped call), and that decode
  stage itself, `GenerationMixin._optimize_model_for_decode` (`decode_stage` marks it);
- `ALL_EXPERTS_FUNCTIONS`: the experts-implementation registry (`register(name, fn)`,
  `_global_mapping` name -> fn);
- on an experts module: `has_gate`, `has_bias`, `is_transposed`, `has_post_expert_norm`, and
  `_apply_gate` (gated) or `act_fn`, and `post_expert_norm` when flagged: what `grouped_mm_experts_forward` reads.

`check()` verifies the transformers version (`TESTED`) and the presence and signature of all of
these, and raises `TransformersVersionError` (one line naming the installed version) when they
changed. Nothing else in moeflow imports them; tests/test_tx_compat.py checks their behaviour.

It also holds what changed name between transformers releases: `kv_cache_kwargs` (a model's KV-cache
forward keyword, `cache` or the older `past_key_values`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModelError

TESTED = ("5.20", "6")  # transformers >= TESTED[0], < TESTED[1] (as in pyproject.toml)
GROUPED_LINEAR_PARAMS = ("input", "weight", "offs", "bias", "is_transposed")
EXPERTS_ATTRS = ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm")  # + _apply_gate or act_fn


class TransformersVersionError(UnsupportedModelError):
    """The installed transformers lacks (or changed) a private MoE internal the offload engine uses."""


def _version() -> str:
    import transformers

    return str(getattr(transformers, "__version__", "unknown"))


def _fail(what: str) -> TransformersVersionError:
    return TransformersVersionError(
        f"transformers {_version()} {what}; moeflow's offload engine is tested with "
        f"transformers>={TESTED[0]},<{TESTED[1]}: install a version in that range"
    )


def _in_range(version: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version)
    except InvalidVersion:
        return False
    return Version(TESTED[0]) <= v < Version(TESTED[1])


def check() -> None:
    """Raise `TransformersVersionError` unless the installed transformers has what the engine uses."""
    _checked()


@functools.cache
def _checked() -> Any:
    """`transformers.integrations.moe` once it passed every check (cached; `_checked.cache_clear()` re-checks)."""
    if not _in_range(_version()):
        raise _fail("is outside the tested range")
    try:
        from transformers.integrations import moe
    except ImportError as e:
        raise _fail(f"has no transformers.integrations.moe ({e})") from None
    fn = getattr(moe, "_grouped_linear", None)
    if not callable(fn):
        raise _fail("has no transformers.integrations.moe._grouped_linear")
    params = tuple(inspect.signature(fn).parameters)
    if params != GROUPED_LINEAR_PARAMS:
        raise _fail(f"changed _grouped_linear{params} (expected {GROUPED_LINEAR_PARAMS})")
    reg = getattr(moe, "ALL_EXPERTS_FUNCTIONS", None)
    if reg is None or not hasattr(reg, "register") or not isinstance(getattr(reg, "_global_mapping", None), dict):
        raise _fail("has no ALL_EXPERTS_FUNCTIONS registry with register() and _global_mapping")
    return moe


def check_experts_module(module: nn.Module) -> None:
    """Raise `TransformersVersionError` unless `module` has the attributes the grouped compute reads."""
    missing = [a for a in EXPERTS_ATTRS if not hasattr(module, a)]
    if not missing:  # what the flags select: the gate or the activation, the norm
        needs = ["_apply_gate" if module.has_gate else "act_fn"]
        needs += ["post_expert_norm"] if module.has_post_expert_norm else []
        missing = [a for a in needs if not hasattr(module, a)]
    if missing:
        raise _fail(f"experts module {type(module).__name__} lacks {', '.join(missing)}")


def grouped_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    is_transposed: bool = False,
) -> torch.Tensor:
    """transformers' `_grouped_linear`: rows offs[g-1]:offs[g] of input [S,in] times expert g's weight -> [S,out]."""
    return _checked()._grouped_linear(input, weight, offs, bias=bias, is_transposed=is_transposed)


BATCHED_LINEAR_PARAMS = ("input", "weight", "bias", "is_transposed")


@functools.cache
def decode_batched() -> Callable[..., Any] | None:
    """transformers' `_batched_linear` when its `generate` switches a `grouped_mm` model to `batched_mm` for the
    decode stage off the CPU (`GenerationMixin._optimize_model_for_decode`, transformers >= 5.2x): the resident
    reference's decode there gathers each row's expert weights and runs `bmm`. None when either is missing or
    changed (the engine then keeps its sorted grouped call everywhere)."""
    moe = _checked()
    try:
        from transformers.generation.utils import GenerationMixin
    except ImportError:
        return None
    fn = getattr(moe, "_batched_linear", None)
    if not callable(fn) or not hasattr(GenerationMixin, "_optimize_model_for_decode"):
        return None
    if tuple(inspect.signature(fn).parameters) != BATCHED_LINEAR_PARAMS:
        return None
    return fn


@contextlib.contextmanager
def decode_stage(model: nn.Module, flag: Callable[[bool], None]) -> Iterator[None]:
    """While attached: `flag(True)` on entering the decode stage of transformers' `generate` on `model` (its
    `_optimize_model_for_decode` context, where a `grouped_mm` model decodes with `batched_mm` off the CPU) and
    `flag(False)` on leaving it; the stock context still runs inside. A model without that context: nothing."""
    name = "_optimize_model_for_decode"
    prev = model.__dict__.get(name)  # another attached wrapper (kept and restored), else the class method
    stock = getattr(type(model), name, None)
    if prev is None and stock is None:
        yield
        return

    enter: Callable[[], Any] = prev if prev is not None else (lambda: stock(model))  # type: ignore[misc]

    @contextlib.contextmanager
    def staged() -> Iterator[None]:
        with enter():
            flag(True)
            try:
                yield
            finally:
                flag(False)

    object.__setattr__(model, name, staged)  # the instance's, over the class method
    try:
        yield
    finally:
        if model.__dict__.get(name) is staged:
            if prev is None:
                object.__delattr__(model, name)
            else:
                object.__setattr__(model, name, prev)
        flag(False)


def registered_experts(name: str) -> Callable[..., Any] | None:
    """The function registered under `name` in transformers' experts interface, or None."""
    return _checked().ALL_EXPERTS_FUNCTIONS._global_mapping.get(name)


def register_experts(name: str, fn: Callable[..., Any]) -> None:
    """Idempotent: make `fn` the experts implementation `name` (`model.set_experts_implementation(name)`)."""
    if registered_experts(name) is not fn:
        _checked().ALL_EXPERTS_FUNCTIONS.register(name, fn)


def kv_cache_kwargs(model: nn.Module) -> dict[str, Any]:
    """`{name: DynamicCache}`: a fresh, empty KV cache for `model`, under the keyword its forward takes.

    transformers renamed the forward keyword `past_key_values` to `cache` (the old name warns with a
    FutureWarning and goes away in 5.40); the cache object is filled in place by each forward call, so the
    caller keeps passing the same dict and never reads the cache back from the output."""
    from transformers import DynamicCache

    name = _cache_keyword(type(model))
    return {name: DynamicCache(config=getattr(model, "config", None))}


def _cache_keyword(cls: type[nn.Module]) -> str:
    """`cache` where the model class's forward takes it, else the older `past_key_values`."""
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return "cache"
    return "cache" if "cache" in params else "past_key_values"
