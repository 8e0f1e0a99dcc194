"""The staged prefill path: a prefill pass moves each layer's routed experts as staged batches, double-buffered.

A decode pass routes one token per row: its experts are few and the per-layer step (`runtime/step.py`) with a
prefetch policy serves it. A prefill pass routes every prompt token at once, so a layer usually needs most of
its experts, often more than the cache holds, and copying them one wave after another with nothing computing in
between is what makes the first token slow. `StagedPrefill` takes over the prefill passes of an engine:

1. at a MoE layer's router hook its routed experts R_l (unique, sorted) are known (ONE host read, which also
   carries the pre-gate counts of step 3): queued copies of l's experts outside R_l are withdrawn
   (`cache.cancel_stale`); R_l is cut into waves (`plan`): the ready ones in waves of at most w, then the ones
   still to copy (in flight first, then misses) in at least `PIPELINE` waves of at most w, so compute starts
   once the first of them has landed; the first wave is demanded at once, as one batch (pinned, its copies
   handed to the link together: `Link.batch`);
2. in the experts call, before wave i waits and computes, the waves after it are demanded as far as the slots
   allow (wave i+1 always: two waves never pin more than the part holds), so copies run during compute;
3. with a prefetch policy (staging is speculative: none without one), once every wave of l is demanded and
   slots are free: the policy's step (its proposals, through its gate, as in every pass), then the next MoE
   layer's experts predicted from l's router input through the next layer's router (the pre-gate: every
   token's top-k, most-routed first) into the slots of its part that no wave pins and no expert of that layer
   holds (`cache.stage`, prefetch priority: demand copies overtake them while queued). They land during l's
   compute and the next layer's attention; when it routes they are resident and form its first waves.

Chunking. w = max(1, min(wave capacity, part capacity // 2)): a prompt that routes more experts than the cache
holds is computed in chunks of its layer's experts. Each chunk computes ALL the rows its experts get (the stock
call's rows of that expert, in the stock order), so the output is bit-identical to the stock `grouped_mm`;
chunking by experts rather than by token ranges also copies each routed expert once per layer, where token
chunks would copy an expert again for every chunk that routes to it.

The TTFT bound. `begin` snapshots the resident keys; every prefill routing adds its experts that were not
resident at the pass start to `needed` (staged or serial, deferred layers included): the copies no schedule can
avoid. The bound of a prefill is max(resident prefill time, needed x link seconds per expert)
(`RunMetrics.set_ttft_bound`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .cache import ExpertCache

if TYPE_CHECKING:
    from .passstats import PassAccount

Routed = Any  # `runtime/step.Routed` (step imports this module): experts, scores, waves, first, ahead, then

PREFILL_PATHS = ("staged", "serial")  # staged: this module; serial: the per-layer step alone (waves one by one)
PIPELINE = 4  # a layer's experts still to copy are computed in at least this many waves (compute starts sooner)


class StagedPrefill:
    """One engine's prefill passes (see the module docstring). `enabled=False` keeps only the bound's count."""

    def __init__(
        self,
        *,
        cache: ExpertCache,
        spec: Any,
        wave_cap: int,
        account: PassAccount,
        predict_logits: Callable[[int, torch.Tensor], torch.Tensor],
        enabled: bool = True,
        stage_next: bool = True,
    ):
        self.cache, self.spec, self.account = cache, spec, account
        self.predict_logits = predict_logits
        self.enabled = enabled
        self.stage_next = stage_next  # predict and stage the next layer's experts (speculative: a prefetch policy is on)
        self.wave = max(1, min(wave_cap, cache.part_capacity // 2))  # w: experts per staged wave
        layers = list(spec.moe_layers)
        self.next_layer = {l: (layers[i + 1] if i + 1 < len(layers) else None) for i, l in enumerate(layers)}
        self.prefill = False  # the running pass is a prefill
        self.active = False  # ... and this path runs it
        self.resident0: set[tuple[int, int]] = set()  # keys resident when the prefill began
        self.needed = 0  # routed experts of this prefill not resident at its start (the bound's copies)
        self.staged = 0  # next-layer copies this prefill issued
        self.waves_run = 0  # waves this prefill computed (more than the MoE layers: chunked)

    def begin(self, decode: bool) -> None:
        """A forward pass starts: a prefill (not `decode`) is counted, and run here when enabled."""
        self.prefill = not decode
        self.active = self.enabled and self.prefill
        self.needed = self.staged = self.waves_run = 0
        self.resident0 = set(self.cache.slot_of) if self.prefill else set()

    def count(self, layer: int, experts: list[int]) -> None:
        """Layer `layer` of the prefill routed to `experts` (each once): count the ones it must copy."""
        r0 = self.resident0
        self.needed += sum((layer, e) not in r0 for e in experts)

    # ---- the router hook ---------------------------------------------------------------------------
    def next_ready(self, layer: int) -> bool:
        """Nothing to stage after `layer`: it is the last MoE layer or the next one is all in ready slots."""
        nxt = self.next_layer.get(layer)
        return nxt is None or not self.stage_next or self.cache.layer_all_ready(nxt)

    def route(self, layer: int, routed: Routed, counts: torch.Tensor | None) -> None:
        """Plan `routed`'s waves, demand the first one now; `counts [E]` (host): tokens the next layer's router
        sends to each expert (`predict`); a one-wave layer stages them at once (nothing of it is left to demand)."""
        cache = self.cache
        experts = routed.experts or []
        cache.cancel_stale(layer, experts)  # queued copies of this layer that it does not route: withdrawn
        waves = self.plan(layer, experts)
        routed.waves = waves
        nxt = self.next_layer.get(layer)
        if nxt is not None and counts is not None:
            c = counts.tolist()
            routed.ahead = (nxt, sorted((e for e in range(len(c)) if c[e] > 0), key=lambda e: (-c[e], e)))
        with cache.link.batch():
            routed.first = self.demand(layer, waves[0], routed.scores or {}) if waves else []
            if len(waves) <= 1 and routed.ahead is not None:
                self.stage_ahead(routed)

    def plan(self, layer: int, experts: list[int]) -> list[list[int]]:
        """`experts` in waves, each sorted by id: the ready ones in waves of at most w, then the ones still to copy
        (in flight first, then misses) in at least `PIPELINE` waves of at most w, so compute starts once the
        first of them has landed while the others are still copying."""
        if not experts:
            return []
        cache, w = self.cache, self.wave
        slot_of = cache.slot_of
        ready = [e for e in experts if (layer, e) in slot_of and cache.is_ready((layer, e))]
        if len(ready) == len(experts) and len(experts) <= w:
            return [list(experts)]
        rs = set(ready)
        rest = sorted((e for e in experts if e not in rs), key=lambda e: ((layer, e) not in slot_of, e))
        g = max(1, min(w, -(-len(rest) // PIPELINE)))
        waves = [ready[i : i + w] for i in range(0, len(ready), w)]
        return waves + [sorted(rest[i : i + g]) for i in range(0, len(rest), g)]

    def demand(self, layer: int, experts: list[int], scores: dict[int, float]) -> list[int]:
        """One wave demanded as a batch (pinned, copies issued, not waited for); loads booked to the layer."""
        cache = self.cache
        loads0 = cache.counters.loads
        with cache.link.batch():  # the wave's copies handed to the link together
            slots = cache.demand(layer, experts, {e: scores.get(e, 0.0) for e in experts})
        self.account.count_loads(layer, cache.counters.loads - loads0)
        return slots

    def predict(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """The pre-gate: tokens the NEXT MoE layer's router sends to each expert `[E]` (on the device; None after
        the last MoE layer or without `stage_next`), from this layer's router input `x [...,H]`: every token's top-k."""
        nxt = self.next_layer.get(layer)
        if nxt is None or not self.stage_next:
            return None
        with torch.no_grad():
            logits = self.predict_logits(nxt, x.reshape(-1, x.shape[-1]))  # [T,E]
            top = logits.topk(min(self.spec.top_k, logits.shape[-1]), dim=-1).indices.reshape(-1)  # [T*k]
            return torch.bincount(top, minlength=logits.shape[-1])  # [E]

    def stage_ahead(self, routed: Routed, final: bool = False) -> None:
        """Every wave of the layer is demanded: once slots are free (or at its last wave, `final`), the prefetch
        policy's step (`Routed.then`); then as many of the next layer's predicted experts as the slots of its part
        that no wave pins hold (prefetch priority: demand copies overtake them while queued). Called again as
        waves release their slots; `final` ends it."""
        if routed.ahead is None and routed.then is None:
            return
        cache = self.cache
        nxt = routed.ahead[0] if routed.ahead is not None else None
        room = cache.stage_room(nxt) if nxt is not None else 0
        if routed.then is not None and (room > 0 or final):
            then, routed.then = routed.then, None
            with cache.link.batch():
                then()
            room = cache.stage_room(nxt) if nxt is not None else 0
        if routed.ahead is None:
            return
        layer, experts = routed.ahead
        if final:
            routed.ahead = None
        if room <= 0:
            return
        keys = [(layer, e) for e in experts if (layer, e) not in cache.slot_of][:room]
        if keys:
            loads0 = self.cache.counters.loads
            with self.cache.link.batch():
                self.staged += self.cache.stage(keys, layer)
            self.account.count_loads(layer, self.cache.counters.loads - loads0)

    # ---- the experts call ----------------------------------------------------------------------------
    def compute(
        self,
        call: Any,
        module: torch.nn.Module,
        layer: int,
        x_g: torch.Tensor,
        eg: torch.Tensor,
        table: torch.Tensor,
        routed: Routed,
    ) -> torch.Tensor:
        """Every sorted row `x_g [S,H]` (experts `eg [S]`, ascending) through its expert, wave by wave -> [S,H]:
        before wave i waits and computes, the waves after it are demanded as far as the slots allow (wave i+1 at
        least: two waves never pin more than the part holds), then the next layer is staged."""
        cache, account = self.cache, self.account
        waves = routed.waves or []
        pinned: dict[int, list[int]] = {0: routed.first or []}
        ahead = 1  # the first wave not demanded yet
        room = cache.part_capacity
        scores = routed.scores or {}
        S = eg.numel()
        out_g: torch.Tensor | None = None
        for i, experts in enumerate(waves):
            t0 = time.perf_counter()
            held = sum(len(p) for p in pinned.values())
            with cache.link.batch():  # this step's copies handed to the link together
                while ahead < len(waves) and (ahead == i + 1 or held + len(waves[ahead]) <= room):
                    pinned[ahead] = self.demand(layer, waves[ahead], scores)
                    held += len(waves[ahead])
                    ahead += 1
                if ahead == len(waves):
                    self.stage_ahead(routed, final=i == len(waves) - 1)
            slots = pinned.pop(i)
            cache.wait(slots)
            account.book(time.perf_counter() - t0)
            if len(waves) == 1:  # the whole call in one grouped call
                out_g = call._grouped(module, x_g, eg, table[eg], len(experts))  # [S,H]
            else:
                rows, eg_w = call._rows(experts, eg)  # [S_w] rows of this wave, their experts sorted
                proj = call._grouped(module, x_g[rows], eg_w, table[eg_w], len(experts))  # [S_w,H]
                out_g = _put(out_g, rows, proj, S)
            cache.release(slots)
            self.waves_run += 1
        if out_g is None:  # unreachable: a routed call has at least one expert
            raise RuntimeError(f"layer {layer}: no expert computed")
        return out_g

    def release(self, routed: Routed) -> None:
        """A routing that will not be computed as planned: unpin its first wave."""
        if routed.first:
            self.cache.release(routed.first)
        routed.first = None
        routed.waves = None
        routed.then = routed.ahead = None


def _put(out_g: torch.Tensor | None, rows: torch.Tensor, proj: torch.Tensor, n: int) -> torch.Tensor:
    """`proj [S_w,H]` into rows `rows` of the `[n,H]` output (allocated on first use)."""
    if out_g is None:
        out_g = torch.empty(n, proj.shape[-1], dtype=proj.dtype, device=proj.device)
    out_g[rows] = proj
    return out_g
