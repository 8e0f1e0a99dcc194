"""The CasMoE plan in `moeflow run --plan casmoe`: the run-time side of the planner.

Before a prompt is decoded the cascade planner (`gate.py`) predicts its pattern EP [L,K]; the plan is, per
MoE layer, the top `k` experts of the pattern (default 2 x the model's top-k) or the experts up to
cumulative share `mass` (`--plan-opt mass=0.8`). Two modes (`--plan-opt mode=`):

- `preload` (default, exact): at the start of the prompt's prefill pass the planned experts are issued
  through the cache's prefetch path (highest-scored first when they exceed the capacity, in layer order),
  so they load while the prefill runs; what the prefill's own working set evicted is issued again when
  the first decode pass starts, so the plan is resident (or in flight) before it; the eviction policy
  is wrapped so that it picks an unplanned victim whenever one is a candidate (`KeepPlanned`); misses are
  fetched; the run's prefetcher works as without a plan. Copies count in the prompt's prefill.
- `restricted` (LOSSY, as CasMoE): the same preload, and routing chooses only among the planned experts
  (`moeflow.policies.routing.PlanRestricted`; every layer keeps at least top-k). Weights: by default the
  family's own weighting computed over the planned experts only (a softmax's denominator is the planned
  set: CasMoE's renormalisation); `renorm=false` keeps the model's weights of the chosen experts.

A batch (`--batch-size` > 1) uses the union of its prompts' plans. The plan applies to `--mode offload` runs
(resident and on-demand runs of a sweep run without it). Each prompt reports which path served it
(`eam` / `eap`), the best EAM cosine, the planner's time and the planned / preloaded experts (`plan`).

`--plan-opt update=true` feeds the EAM: after each prompt's first planned offload run
its observed EP (eq. 3 over its prefill tokens, from the router outputs the engine saw, before any
restriction: `labels.ep_from_routing`) goes with the prompt text to the EAM's buffer of C entries
(`buffer=C`, default the EAM's own, 30), which updates the database when full; at the end of the run the
EAM (buffer flushed) replaces `<predictors>/eam` atomically (`EAM.save_atomic`: `eam` becomes a link
into `.eam.versions/` inside the resolved predictor folder). Plans already made are not re-made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..policies.routing import PlanRestricted
from .gate import DEFAULT_EPS, CascadePlanner, Plan

PLANS = ("casmoe",)
PLAN_MODES = ("preload", "restricted")
PLAN_KEYS = ("predictors", "mode", "eps", "k", "mass", "renorm", "update", "buffer")
TRAIN_HINT = "`moeflow train --only eam --only eap`"


@dataclass(frozen=True)
class PlanSpec:
    predictors: str
    mode: str = "preload"
    eps: float = DEFAULT_EPS
    k: int | None = None  # experts per layer; None: 2 x top-k (unless mass)
    mass: float | None = None
    renorm: bool = True
    update: bool = False  # feed observed EPs to the EAM and save it at the end
    buffer: int | None = None  # the EAM's update buffer C (None: the saved EAM's)

    @property
    def lossy(self) -> bool:
        return self.mode == "restricted"

    def describe(self) -> str:
        size = f"mass={self.mass}" if self.mass is not None else f"k={self.k if self.k is not None else '2xtop-k'}"
        return f"casmoe:{self.mode} {size} eps={self.eps}"


def _bool(v: str, key: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"--plan-opt {key}={v!r}: use true or false")


def parse_plan(
    plan: str | None, opts: Sequence[tuple[str, str]], prefetch_opts: Sequence[tuple[str, str]] = ()
) -> PlanSpec | None:
    """The `--plan` / `--plan-opt` flags checked (no disk access); None without --plan. The predictor folder
    defaults to the prefetchers' (`--prefetch-opt predictors=DIR`)."""
    if plan is None:
        if opts:
            raise ConfigError("--plan-opt needs --plan casmoe")
        return None
    if plan not in PLANS:
        raise ConfigError(f"--plan {plan!r} unknown; use {', '.join(PLANS)}")
    d = dict(opts)
    bad = sorted(set(d) - set(PLAN_KEYS))
    if bad:
        raise ConfigError(f"--plan-opt {', '.join(bad)} unknown; casmoe takes {', '.join(PLAN_KEYS)}")
    mode = d.get("mode", "preload")
    if mode not in PLAN_MODES:
        raise ConfigError(f"--plan-opt mode={mode!r} unknown; use {' or '.join(PLAN_MODES)}")
    folder = d.get("predictors") or dict(prefetch_opts).get("predictors")
    if not folder:
        raise ConfigError(
            f"--plan casmoe needs --plan-opt predictors=DIR (a predictor folder with eam/ or eap/ from {TRAIN_HINT})"
        )
    try:
        eps = float(d.get("eps", DEFAULT_EPS))
        k = int(d["k"]) if "k" in d else None
        mass = float(d["mass"]) if "mass" in d else None
        buffer = int(d["buffer"]) if "buffer" in d else None
    except ValueError as e:
        raise ConfigError(f"--plan-opt: {e}") from None
    if k is not None and mass is not None:
        raise ConfigError("--plan-opt k= and mass= exclude each other; give one")
    if k is not None and k < 1:
        raise ConfigError(f"--plan-opt k must be >= 1 (got {k})")
    if mass is not None and not 0 < mass <= 1:
        raise ConfigError(f"--plan-opt mass must be in (0, 1] (got {mass})")
    if buffer is not None and buffer < 1:
        raise ConfigError(f"--plan-opt buffer must be >= 1 (got {buffer})")
    update = _bool(d.get("update", "false"), "update")
    if buffer is not None and not update:
        raise ConfigError("--plan-opt buffer= sizes the EAM update buffer; it needs --plan-opt update=true")
    return PlanSpec(str(folder), mode, eps, k, mass, _bool(d.get("renorm", "true"), "renorm"), update, buffer)


def check_plan_folder(spec: PlanSpec) -> None:
    """Before the model loads: the predictor folder exists and holds eam/ or eap/."""
    p = Path(spec.predictors)
    if not p.is_dir():
        raise ConfigError(f"--plan casmoe: predictor folder {p} does not exist; create it with {TRAIN_HINT}")
    if not (p / "eam").is_dir() and not (p / "eap").is_dir():
        raise ConfigError(f"--plan casmoe: {p} holds no eam/ or eap/; run {TRAIN_HINT}")


class KeepPlanned:
    """An eviction policy that evicts a planned expert only when every candidate is planned; everything else
    (events, tie-breaking among the unplanned) is the wrapped policy's."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.keep: set[tuple[int, int]] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def victim(self, candidates: Sequence[tuple[int, int]], pos: Any) -> tuple[int, int]:
        if self.keep:
            other = [k for k in candidates if k not in self.keep]
            if other and len(other) < len(candidates):
                return self.inner.victim(other, pos)
        return self.inner.victim(candidates, pos)


class RunPlanner:
    """A `CascadePlanner` bound to a model and a `PlanSpec`: plans prompts, prepares engines, applies plans."""

    def __init__(self, spec: PlanSpec, planner: CascadePlanner, model_spec: Any):
        self.spec, self.planner, self.mspec = spec, planner, model_spec
        planner.eps = spec.eps
        E, top_k = model_spec.num_experts, model_spec.top_k
        self.k = spec.k if spec.k is not None else min(E, 2 * top_k)
        if spec.mass is None and not 1 <= self.k <= E:
            raise ConfigError(f"--plan-opt k={self.k} must be between 1 and the model's {E} experts")
        if spec.lossy and spec.mass is None and self.k < top_k:
            raise ConfigError(f"--plan-opt mode=restricted needs k >= the model's top-k ({top_k}); got k={self.k}")
        self.preloaded = 0
        self._hook: Any = None
        self.observed: set[Any] = set()  # prompt ids already fed to the EAM
        self.added = 0
        self.flushed = 0
        if spec.update:
            if planner.eam is None or planner.embedder is None:
                raise ConfigError(f"--plan-opt update=true needs an EAM in {spec.predictors} (eam/); run {TRAIN_HINT}")
            if spec.buffer is not None:
                planner.eam.buffer_size = spec.buffer

    @classmethod
    def load(cls, spec: PlanSpec, model: Any) -> RunPlanner:
        from ..moe import get_adapter, model_fingerprint

        planner = CascadePlanner.load(spec.predictors, fingerprint=model_fingerprint(model), eps=spec.eps)
        return cls(spec, planner, get_adapter(model).spec)

    def plan(self, texts: list[str]) -> list[Plan]:
        plans = self.planner.plan(texts)
        L, E = self.mspec.num_moe_layers, self.mspec.num_experts
        for p in plans:
            if p.ep.shape != (L, E):
                raise ConfigError(f"the planner in {self.spec.predictors} predicts {p.ep.shape}, the model has {(L, E)}")
        return plans

    def experts(self, plan: Plan) -> dict[int, list[int]]:
        """Model layer index -> planned expert ids, highest score first."""
        out: dict[int, list[int]] = {}
        floor = self.mspec.top_k if self.spec.lossy else 1
        for row, layer in zip(plan.ep, self.mspec.moe_layers):
            order = np.argsort(-row, kind="stable")
            if self.spec.mass is None:
                n = self.k
            else:
                pos = np.maximum(row, 0)
                c = np.cumsum(pos[order]) / max(float(pos.sum()), 1e-12)
                n = int(np.searchsorted(c, self.spec.mass - 1e-9)) + 1
            out[int(layer)] = [int(e) for e in order[: max(n, floor)]]
        return out

    def prepare(self, engine: Any) -> None:
        """Before the engine is attached: wrap its eviction policy (keep planned experts preferentially)."""
        if engine.eviction is not None and not isinstance(engine.eviction, KeepPlanned):
            engine.eviction = KeepPlanned(engine.eviction)

    def begin(self, engine: Any, plans: list[Plan]) -> dict[int, list[int]]:
        """Apply the plans of one batch (their union) to an attached engine: planned experts are kept
        preferentially, restricted routing is set, and the preload is issued when the next pass (the
        prefill) starts. Returns the planned experts per layer."""
        sets: dict[int, list[int]] = {}
        scores: dict[tuple[int, int], float] = {}
        for p in plans:
            for (layer, ids), row in zip(self.experts(p).items(), p.ep):
                have = sets.setdefault(layer, [])
                for e in ids:
                    if e not in have:
                        have.append(e)
                    scores[(layer, e)] = max(scores.get((layer, e), -np.inf), float(row[e]))
        keys = [(l, e) for l, ids in sets.items() for e in ids]
        if isinstance(engine.eviction, KeepPlanned):
            engine.eviction.keep = set(keys)
        if self.spec.lossy and isinstance(engine.routing, PlanRestricted):
            engine.routing.set_allowed(sets, self.mspec.num_experts)
        # the best-scored keys that fit the capacity, issued in layer order (the prefill needs layer 0 first)
        fit = sorted(keys, key=lambda k: -scores[k])[: engine.capacity]
        rank = {l: i for i, l in enumerate(self.mspec.moe_layers)}
        fit.sort(key=lambda k: (rank[k[0]], -scores[k]))
        self.preloaded = 0
        passes = [0]

        def preload() -> None:  # prefill start: overlap with the prefill; first decode pass: top up what it evicted
            from ..policies.base import PrefetchRequest

            passes[0] += 1
            if passes[0] >= 2:
                engine.pass_start_hooks.remove(preload)
            n = len(fit)
            reqs = [PrefetchRequest(k, priority=float(n - i)) for i, k in enumerate(fit)]
            self.preloaded += engine.cache.prefetch(reqs, self.mspec.moe_layers[0])

        engine.pass_start_hooks.append(preload)
        self._hook = preload
        return sets

    def end(self, engine: Any) -> None:
        """After the batch: drop a preload that never ran and unrestrict routing."""
        hook = self._hook
        if hook is not None and hook in engine.pass_start_hooks:
            engine.pass_start_hooks.remove(hook)
        if isinstance(engine.routing, PlanRestricted):
            engine.routing.set_allowed(None, self.mspec.num_experts)

    @contextlib.contextmanager
    def observing(self, engine: Any, batch: Sequence[tuple[Any, str, Any]]) -> Iterator[None]:
        """Around one batch's generation on an attached engine (`batch`: (prompt id, text, ids [1,P])):
        with `update`, each prompt not observed before has its prefill routing summed into its EP (eq. 3)
        and fed with its text to the EAM buffer."""
        new = [i for i, (pid, _, _) in enumerate(batch) if pid not in self.observed]
        if not self.spec.update or not new:
            yield
            return
        from ..moe import router_hooks

        lens = [int(ids.shape[-1]) for _, _, ids in batch]
        T = max(lens)
        passes = [0]
        routed: dict[int, tuple[np.ndarray, np.ndarray]] = {}

        def on_pass() -> None:
            passes[0] += 1

        def on_route(ev: Any) -> None:
            if passes[0] == 1:  # the prefill: rows are [B*T], left-padded
                routed[ev.layer] = (ev.indices.cpu().numpy(), ev.weights.float().cpu().numpy())

        from .labels import ep_from_routing

        engine.pass_start_hooks.append(on_pass)
        try:
            with router_hooks(engine.adapter, on_route, prepend=True):  # the router's own output
                yield
        finally:
            engine.pass_start_hooks.remove(on_pass)
        layers = self.mspec.moe_layers
        if any(l not in routed for l in layers):
            return
        for i in new:
            pid, text, _ = batch[i]
            rows = slice(i * T + T - lens[i], (i + 1) * T)
            ep = ep_from_routing(
                [routed[l][0][rows] for l in layers], [routed[l][1][rows] for l in layers], self.mspec.num_experts
            )
            self.flushed += int(self.planner.observe(text, ep))
            self.added += 1
            self.observed.add(pid)

    def save_update(self) -> dict[str, Any] | None:
        """With `update`: the EAM (buffer flushed) replaces `<predictors>/eam` atomically; the run's record."""
        eam = self.planner.eam
        if not self.spec.update or eam is None:
            return None
        meta = dict(self.planner.info.get("eam") or {})
        fp, emb = str(meta.get("model_fingerprint", "")), str(meta.get("embedder", ""))
        keep = set(eam.options()) | {
            "kind",
            "schema",
            "model_fingerprint",
            "embedder",
            "dim",
            "num_layers",
            "num_experts",
            "entries",
            "flushes",
        }
        extra = {k: v for k, v in meta.items() if k not in keep}
        folder = Path(self.spec.predictors).resolve() / "eam"
        if self.added:
            eam.save_atomic(folder, fingerprint=fp, embedder=emb, extra=extra)
        return {"added": self.added, "flushed": self.flushed, "db_size": len(eam), "saved": str(folder) if self.added else None}

    @staticmethod
    def report(plan: Plan, sets: dict[int, list[int]], preloaded: int) -> dict[str, Any]:
        """The per-prompt `plan` record of run --json / --out."""
        return {
            "path": plan.path,
            "best_sim": round(float(plan.best_sim), 4),
            "ms": round(float(plan.ms), 3),
            "planned_experts": sum(len(v) for v in sets.values()),
            "preloaded": preloaded,
        }

    def summary(self, plans: list[Plan]) -> dict[str, Any]:
        paths = [p.path for p in plans]
        ms = [p.ms for p in plans] or [0.0]
        return {
            "plan": "casmoe",
            "mode": self.spec.mode,
            "lossy": self.spec.lossy,
            "k": None if self.spec.mass is not None else self.k,
            "mass": self.spec.mass,
            "eps": self.spec.eps,
            "renorm": self.spec.renorm if self.spec.lossy else None,
            "predictors": self.spec.predictors,
            "split": {"eam": paths.count("eam"), "eap": paths.count("eap")},
            "ms_per_prompt": round(float(np.mean(ms)), 3),
        }
