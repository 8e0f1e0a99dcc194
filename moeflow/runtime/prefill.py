"""The staged prefill path: a prefill pass moves each layer's routed experts as staged batches, double-buffered.

A decode pass routes one token per row: its experts are few and the per-layer step (`runtime/step.py`) with a
prefetch policy serves it. A prefill pass routes every prompt token at once, so a layer usually needs most of
its experts, often more than the cache holds, and copying them one wave after another with nothing computing in
between is what makes the first token slow. `StagedPrefill` takes over the prefill passes of an engine:

0. with a prefetch policy, at the pass start (`start`, after the bound's snapshot): the first MoE layer's
   experts predicted by its router from the embeddings are staged (the slots `stage_room` gives), so the link
   copies from the first moment, not from the first router; the later layers' likewise into empty slots only,
   layer by layer while the first layer's experts call would wait for its copies (`stage_later`: host work
   where the thread idles, not before the first attention), the rest when that call ends. A prompt expected to
   route every expert of each layer (`_expects_all_routed`) computes no pre-gate where its counts would order
   nothing: a layer whose empty slots take all its experts not in a slot is staged whole, unpredicted (a cache
   of every expert: every layer, `_routes_every`), and a router hook whose next layer fits in the part predicts
   every expert of it (`predict`; staged in id order, as the counts would order them);
1. at a MoE layer's router hook its routed experts R_l (unique, sorted) are known (ONE host read, which also
   carries the pre-gate counts of step 3; R_l, its summed gate weights and its rows per expert from one bincount
   and one `index_add_` by expert id, `counters.routed_counts`, no sort nor Python set): queued copies of l's
   experts outside R_l are withdrawn (`cache.cancel_stale`); R_l is cut into waves of consecutive experts (`plan`;
   each wave's rows are one slice of the sorted rows): a wave closes at w experts or at ceil(still to copy /
   `PIPELINE`) of them still to copy, so compute starts once the first few have landed; the first wave is demanded
   at once, as one batch (pinned, its copies handed to the link together: `Link.batch`; demand copies overtake the
   queued staged ones, so the link copies the layer in wave order);
2. in the experts call, before wave i waits and computes, the waves after it are demanded as far as the slots
   allow (wave i+1 always: two waves never pin more than the part holds), each wave's copies handed to the link
   apart (`cache.cut`: a link joining adjacent rows never makes a wave wait for the next), so copies run during
   compute; the
   demanded waves right after i whose copies have all landed join its grouped call (up to w experts: `compute`):
   the plan cuts waves for copies still to come, and where compute lags the link (the host's per-call work on a
   small model) they have landed by then, so one call does what several would, with nothing more to wait for;
3. with a prefetch policy (staging is speculative: none without one), once every wave of l is demanded and slots
   are free: the next MoE layer's experts predicted from l's router input through the next layer's router (the
   pre-gate: every token's top-k; in id order when they all fit in the part, else the most-routed first) into the
   slots of its part that no wave pins and no expert of that layer holds (`cache.stage`, prefetch priority: demand
   copies overtake them while queued), again as waves release their slots. They land during l's compute and the
   next layer's attention; when it routes they are resident and form its first waves. The copies of one step
   (demanded and staged) go to the link as one batch (`cache.batch`: one schedule insertion per run of equal
   priority, one device-table write). The policy's own step (its proposals, through its gate) runs after the last
   MoE layer only (for the next pass): after the others the pre-gate stages what it would propose for the next
   layer, without its per-layer host work (`step_needed`); it is skipped there too when it can change nothing
   (`step_useless`: a cache of every expert, every later layer's experts in slots); when it runs, it reuses the
   router logits the pre-gate computed (`logits`).
4. a wave whose slots ascend with its experts (`slot_span`) reads their weights in place
   (`grouped_experts_in_place`) instead of gathering them; a staged batch deals its slots to its keys in
   ascending order (`cache.stage`), so a cold prefill and one that evicts alike find a layer's staged experts in
   ascending slots; a wave whose slots span as densely in another order (a demanded miss among staged experts)
   is computed in place on its rows taken in slot order and put back (`wave_rows`): moving a wave's rows
   costs less than gathering its experts' weights, and every group holds the same rows in the same order.

Chunking. w = max(1, min(wave capacity, part capacity // 2)): a prompt that routes more experts than the cache
holds is computed in chunks of its layer's experts. Each chunk computes ALL the rows its experts get (the stock
call's rows of that expert, in the stock order), so the output is bit-identical to the stock `grouped_mm`;
chunking by experts rather than by token ranges also copies each routed expert once per layer, where token
chunks would copy an expert again for every chunk that routes to it.

The TTFT bound. `begin` snapshots the resident keys; every prefill routing adds its experts that were not
resident at the pass start to `needed` (staged or serial, deferred layers included): the copies no schedule can
avoid. The bound of a prefill is max(resident prefill time, needed x link seconds per expert)
(`RunMetrics.set_ttft_bound`).

How close a staged prefill comes to its bound is in docs/run.md (`benchmarks/prefill.py`): where the link keeps
up, what is left is host work on the compute thread (per-key cache bookkeeping, per-wave calls) and, on a loaded
host, the emulated link's copies taking its core.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import torch

from .cache import ExpertCache

if TYPE_CHECKING:
    from .passstats import PassAccount

Routed = Any  # `runtime/step.Routed` (step imports this module): experts, scores, waves, ends, first, ahead, then

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
        self._memo: tuple[int, torch.Tensor, int, torch.Tensor] | None = None  # (target, x, x's version, logits)
        self._later: tuple[list[int], torch.Tensor, bool] | None = None  # later MoE layers to stage: them, embeddings, all
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
        self._all_routed = False  # the running prefill is expected to route every expert of each layer (`start`)

    def begin(self, decode: bool) -> None:
        """A forward pass starts: a prefill (not `decode`) is counted, and run here when enabled."""
        self.prefill = not decode
        self.active = self.enabled and self.prefill
        self.needed = self.staged = self.waves_run = 0
        self.resident0 = set(self.cache.slot_of) if self.prefill else set()
        self._memo = self._later = None
        self._all_routed = False

    def count(self, layer: int, experts: list[int]) -> None:
        """Layer `layer` of the prefill routed to `experts` (each once): count the ones it must copy."""
        r0 = self.resident0
        self.needed += sum((layer, e) not in r0 for e in experts)

    # ---- the router hook ---------------------------------------------------------------------------
    def next_ready(self, layer: int) -> bool:
        """Nothing to stage after `layer`: it is the last MoE layer or the next one is all in ready slots."""
        nxt = self.next_layer.get(layer)
        return nxt is None or not self.stage_next or self.cache.layer_all_ready(nxt)

    def step_useless(self, layer: int) -> bool:
        """The prefetch policy's step after `layer` can change nothing: the cache holds every expert (it never
        evicts, so a proposal of a resident expert moves no eviction order) and every later MoE layer has all its
        experts in slots (nothing it proposes is missing)."""
        cache = self.cache
        if cache.capacity < self.spec.total_experts:
            return False
        return all(cache.layer_full(l) for l in self.spec.moe_layers if l > layer)

    def step_needed(self, layer: int) -> bool:
        """The prefetch policy's step after `layer` may add something: not when the staged path stages the next
        MoE layer from its pre-gate (what a step would propose for it, without its per-layer host work) and not
        when it can change nothing (`step_useless`). After the last MoE layer it runs (the next pass's layers)."""
        if self.stage_next and self.next_layer.get(layer) is not None:
            return False
        return not self.step_useless(layer)

    def route(self, layer: int, routed: Routed, counts: torch.Tensor | None, per: list[int] | None = None) -> None:
        """Plan `routed`'s waves, demand the first one now; `counts [E]` (host): tokens the next layer's router
        sends to each expert (`predict`); a one-wave layer stages them at once (nothing of it is left to demand).
        `per [E]`: rows this layer routes to each expert (`counters.routed_counts`, from the ids the router hook
        read), whose running sums give each wave's rows of the sorted routing (`Routed.ends`), so the experts call
        reads nothing back from the device."""
        cache = self.cache
        if self._later is not None and layer != self.spec.moe_layers[0]:  # the first layer's experts call did not run
            self.stage_later()
        experts = routed.experts or []
        cache.cancel_stale(layer, experts)  # queued copies of this layer that it does not route: withdrawn
        waves = self.plan(layer, experts)
        routed.waves = waves
        if len(waves) > 1 and per is not None:  # rows [ends[e-1], ends[e]) of the sorted routing go to expert e
            routed.ends = list(accumulate(per))  # [E]
        nxt = self.next_layer.get(layer)
        if nxt is not None and counts is not None:
            # all fit in the part: id order, its waves' order (`stage_ahead`); else the most-routed first
            routed.ahead = (nxt, routed_order(counts.tolist(), by_count_above=cache.part_capacity))
        with cache.batch():
            routed.first = self.demand(layer, waves[0], routed.scores or {}) if waves else []
            if len(waves) <= 1 and routed.ahead is not None:
                self.stage_ahead(routed)

    def plan(self, layer: int, experts: list[int]) -> list[list[int]]:
        """`experts` (sorted by id) cut into waves of consecutive ones, so each wave's rows are one slice of the
        sorted rows: a wave closes at w experts or at g of them still to copy, g = ceil(still to copy /
        `PIPELINE`): compute starts once the first few copies have landed while the others are still copying
        (the link copies a layer's experts in wave order: its demand copies overtake its queued staged ones in
        that order). All ready and at most w: one wave; an instant link (copies complete at submit): waves of w."""
        if not experts:
            return []
        cache, w = self.cache, self.wave
        slot_of = cache.slot_of
        todo = [not ((layer, e) in slot_of and cache.is_ready((layer, e))) for e in experts]
        n = sum(todo)
        if n == 0 and len(experts) <= w:
            return [list(experts)]
        g = w if cache.link.instant else max(1, min(w, -(-n // PIPELINE)))
        waves: list[list[int]] = [[]]
        left = 0  # experts of the open wave still to copy
        for e, copy in zip(experts, todo):
            if len(waves[-1]) == w or (copy and left == g):
                waves.append([])
                left = 0
            waves[-1].append(e)
            left += copy
        return waves

    def demand(self, layer: int, experts: list[int], scores: dict[int, float]) -> list[int]:
        """One wave demanded as a batch (pinned, copies issued, not waited for); loads booked to the layer."""
        cache = self.cache
        loads0 = cache.counters.loads
        with cache.batch():  # the wave's copies handed to the link together
            slots = cache.demand(layer, experts, {e: scores.get(e, 0.0) for e in experts})
        self.account.count_loads(layer, cache.counters.loads - loads0)
        return slots

    def predict(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """The pre-gate: tokens the NEXT MoE layer's router sends to each expert `[E]` (on the device; None after
        the last MoE layer or without `stage_next`), from this layer's router input `x [...,H]`: every token's top-k."""
        nxt = self.next_layer.get(layer)
        if nxt is None or not self.stage_next:
            return None
        cache, later = self.cache, self._later
        if cache.capacity >= self.spec.total_experts and cache.layer_full(nxt):  # nothing to stage, ever evicted
            return None
        if later is not None and later[2] and nxt in later[0]:  # `stage_later` stages every one of its experts
            return None
        E = self.spec.num_experts
        if self._all_routed and E <= cache.part_capacity:  # it would predict every expert, staged in id order
            return torch.ones(E, dtype=torch.long, device=x.device)  # [E]
        return self._pregate(nxt, x)

    def _pregate(self, target: int, x: torch.Tensor) -> torch.Tensor:
        """Tokens layer `target`'s router sends to each expert `[E]` (on the device) for inputs `x [...,H]`."""
        with torch.no_grad():
            logits = self.logits(target, x)  # [T,E]
            top = logits.topk(min(self.spec.top_k, logits.shape[-1]), dim=-1).indices.reshape(-1)  # [T*k]
            return torch.bincount(top, minlength=logits.shape[-1])  # [E]

    def logits(self, target: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `target`'s router logits `[T,E]` for inputs `x [...,H]`; the last ones are reused for the same `x`
        (the pre-gate and a prefetch policy's step both apply the next layer's router to a layer's router input)."""
        m, v = self._memo, -1 if x.is_inference() else x._version  # an inference tensor has no version counter
        if m is not None and m[0] == target and m[1] is x and m[2] == v:
            return m[3]
        logits = self.predict_logits(target, x.reshape(-1, x.shape[-1]))  # [T,E]
        self._memo = (target, x, v, logits)
        return logits

    def start(self, x: torch.Tensor | None) -> None:
        """The staged prefill's pass begins (after `begin`), `x [...,H]` its embeddings: with `stage_next`, the
        first MoE layer's experts predicted from them staged at once (into the slots `stage_room` gives), the
        later layers' into EMPTY slots only, as far as they reach, left to `stage_later` (module docstring, 0)."""
        if not (self.active and self.stage_next) or x is None:
            return
        cache, E = self.cache, self.spec.num_experts
        layers = list(self.spec.moe_layers)
        if not cache.per_layer:  # one part: the layers the empty slots may reach (each takes at most E)
            layers = layers[: 1 + max(0, -(-(cache.free_room(layers[0]) - E) // E))]
        self._all_routed = self._expects_all_routed(x)
        every = self._routes_every()
        self._stage_predicted(layers[0], x, cache.stage_room(layers[0]))
        if len(layers) > 1:
            self._later = (layers[1:], x, every)

    def _routes_every(self) -> bool:
        """A cache of every expert and a prefill expected to route them all (`_all_routed`, which `start` sets from
        `_expects_all_routed`): every expert staged, layer by layer, unpredicted."""
        return self._all_routed and self.cache.capacity >= self.spec.total_experts

    def _expects_all_routed(self, x: torch.Tensor) -> bool:
        """A prefill of `x [...,H]`'s T tokens is expected to route every expert of each layer: E (1 - k/E)^T < 0.5
        under uniform top-k routing (olmoe-mini, 256 tokens: 126 of 128 routed; olmoe-deep, E = 32: all). The
        pre-gate (a router product, top-k and count per layer) would predict every expert: where its counts
        order nothing (all fit in the part, or in a staged batch's room) it is not run, at any capacity."""
        E, k, T = self.spec.num_experts, self.spec.top_k, x.shape[:-1].numel()
        return E * (1 - k / E) ** T < 0.5

    def stage_later(self, until: Callable[[], bool] | None = None) -> None:
        """The later MoE layers `start` left, predicted from the embeddings and staged one layer at a time into
        the empty slots, until `until()` (checked before each layer) or all of them."""
        while self._later is not None and (until is None or not until()):
            layers, x, every = self._later
            self._later = (layers[1:], x, every) if len(layers) > 1 else None
            self._stage_predicted(layers[0], x, self.cache.free_room(layers[0]))

    def _landed(self, keys: list[tuple[int, int]]) -> bool:
        """Every one of `keys` is in a ready slot (its copy has landed)."""
        return all(map(self.cache.is_ready, keys))

    def _stage_predicted(self, layer: int, x: torch.Tensor, room: int) -> None:
        """`layer`'s experts predicted from `x [...,H]` (every token's top-k of its router), the most-routed ones
        (at most `room`) not in a slot staged as one batch, in id order (the order of the layer's waves); all of
        them, unpredicted, when every expert is expected routed and `room` holds those not in a slot (always so in
        a cache of every expert: `_routes_every`)."""
        cache = self.cache
        if room <= 0 or cache.layer_full(layer):
            return
        keys = [(layer, e) for e in range(self.spec.num_experts) if (layer, e) not in cache.slot_of]  # id order
        if not (self._all_routed and room >= len(keys)):
            order = routed_order(self._pregate(layer, x).tolist(), by_count_above=0)  # [E] counts read on the host
            keys = sorted([(layer, e) for e in order if (layer, e) not in cache.slot_of][:room])
        if keys:
            n0 = cache.counters.loads
            self.staged += cache.stage(keys, layer)  # one batch
            self.account.count_loads(layer, cache.counters.loads - n0)

    def stage_ahead(self, routed: Routed, final: bool = False) -> None:
        """Every wave of the layer is demanded: once slots are free (or at its last wave, `final`), the prefetch
        policy's step (`Routed.then`); then as many of the next layer's predicted experts as the slots of its part
        that no wave pins hold (prefetch priority: demand copies overtake them while queued). Called again as
        waves release their slots; `final` ends it. The predicted experts come in id order when they all fit in
        the part (`route`): each batch then holds the lowest ids still to copy, the next layer's first waves, in
        ascending slots, so a wave is read in place (olmoe-mini at 25%, per prefill: 7.0 waves in place, 1.9
        with rows reordered, 0 gathered, against 2.0 / 5.7 / 3.0 with the most-routed ones first); when they do
        not all fit, the most-routed first (what the slots can take)."""
        if routed.ahead is None and routed.then is None:
            return
        cache = self.cache
        nxt = routed.ahead[0] if routed.ahead is not None else None
        if routed.then is not None and (final or (nxt is not None and cache.stage_room(nxt) > 0)):
            then, routed.then = routed.then, None
            with cache.link.batch():
                then()
        if routed.ahead is None:
            return
        layer, experts = routed.ahead
        if final:
            routed.ahead = None
        todo = [(layer, e) for e in experts if (layer, e) not in cache.slot_of]  # in `route`'s order
        room = cache.stage_room(layer) if todo else 0
        if room <= 0:
            return
        keys = sorted(todo[:room])  # in id order (as `start`)
        if keys:
            loads0 = self.cache.counters.loads
            self.staged += self.cache.stage(keys, layer)  # one batch
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
        least: two waves never pin more than the part holds), then the next layer is staged; the demanded waves
        after i whose copies have landed are computed with it in one grouped call of at most w experts (their rows
        are the next slices of the sorted rows), the wave after them demanded first."""
        cache, account = self.cache, self.account
        waves = routed.waves or []
        pinned: dict[int, list[int]] = {0: routed.first or []}  # each demanded wave not computed yet: its slots
        ahead = 1  # the first wave not demanded yet
        projs: list[torch.Tensor] = []
        # rows [ends[e-1], ends[e]) of the sorted routing go to expert e: each wave is one slice (the counts the
        # router hook read with the routing; from `eg` only for a routing planned without them: a device read)
        ends = routed.ends or []
        if len(waves) > 1 and not ends:
            ends = torch.bincount(eg, minlength=self.spec.num_experts).cumsum(0).tolist()
        i = 0
        while i < len(waves):
            t0 = time.perf_counter()
            ahead = self._demand_ahead(layer, routed, pinned, ahead, i + 1, cache.part_capacity, i == len(waves) - 1)
            experts, slots = waves[i], pinned.pop(i)
            j = i + 1  # the demanded waves after i whose copies have all landed join its grouped call (at most w)
            while j < ahead and len(experts) + len(waves[j]) <= self.wave and self._landed([(layer, e) for e in waves[j]]):
                experts, slots = experts + waves[j], slots + pinned.pop(j)
                j += 1
            if j > i + 1:  # merged: the wave after them demanded before they compute (two calls never pin more than 2w)
                ahead = self._demand_ahead(layer, routed, pinned, ahead, j, 0, j == len(waves))
            i = j
            if self._later is not None:  # the thread would wait for this wave's copies: stage later layers meanwhile
                self.stage_later(until=partial(self._landed, [(layer, e) for e in experts]))
            cache.wait(slots)
            account.book(time.perf_counter() - t0)
            if len(waves) == 1:  # the whole call in one grouped call
                projs.append(wave_rows(call, module, x_g, eg, table[eg], slots))  # [S,H]
            else:
                a, b = ends[experts[0] - 1] if experts[0] > 0 else 0, ends[experts[-1]]  # this wave's rows
                eg_w = eg[a:b]  # [S_w]
                projs.append(wave_rows(call, module, x_g[a:b], eg_w, table[eg_w], slots))  # [S_w,H]
            cache.release(slots)
            self.waves_run += 1
        self.stage_later()  # what is left of them, before the next layer's attention
        if not projs:  # unreachable: a routed call has at least one expert
            raise RuntimeError(f"layer {layer}: no expert computed")
        return projs[0] if len(projs) == 1 else torch.cat(projs)  # [S,H]: the waves' slices in order

    def _demand_ahead(
        self, layer: int, routed: Routed, pinned: dict[int, list[int]], ahead: int, must: int, room: int, final: bool
    ) -> int:
        """One step's copies as one batch: from wave `ahead` (the first not demanded) on, wave `must` and the waves
        after it while the demanded waves not computed (`pinned`, extended) hold at most `room` slots; once every
        wave is demanded, the next layer staged (`stage_ahead`, `final` at the layer's last grouped call). Returns
        the first wave not demanded."""
        waves, scores = routed.waves or [], routed.scores or {}
        held = sum(len(p) for p in pinned.values())
        with self.cache.batch():  # this step's copies handed to the link together
            while ahead < len(waves) and (ahead == must or held + len(waves[ahead]) <= room):
                pinned[ahead] = self.demand(layer, waves[ahead], scores)
                self.cache.cut()  # each wave's copies apart: a wave is ready when it lands, not with the next
                held += len(waves[ahead])
                ahead += 1
            if ahead == len(waves):
                self.stage_ahead(routed, final=final)
        return ahead

    def release(self, routed: Routed) -> None:
        """A routing that will not be computed as planned: unpin its first wave."""
        if routed.first:
            self.cache.release(routed.first)
        routed.first = None
        routed.waves = routed.ends = None
        routed.then = routed.ahead = None


def routed_order(counts: list[int], by_count_above: int) -> list[int]:
    """The experts with a count above 0 (`counts [E]`: tokens routed to each), in id order when there are at most
    `by_count_above` of them, else the most-routed first (ties in id order)."""
    order = [e for e, n in enumerate(counts) if n > 0]  # id order
    if len(order) > by_count_above:
        order.sort(key=lambda e: -counts[e])  # stable: equal counts keep id order
    return order


def wave_rows(
    call: Any, module: torch.nn.Module, x: torch.Tensor, eg: torch.Tensor, rows: torch.Tensor, slots: list[int]
) -> torch.Tensor:
    """One wave's sorted rows `x [S_w,H]` (experts `eg [S_w]` ascending, `rows [S_w]` each row's slot) through its
    experts, whose pinned `slots` (in expert order) are given -> [S_w,H]. Slots that ascend: the weights read in
    place (`slot_span`); slots that would span densely in another order: the rows taken in slot order (a stable
    sort: each expert's rows keep their order, so every group holds the same rows in the same order and the
    result is bit-identical), computed in place and put back (moving the rows costs less than gathering the
    experts' weights); else the weights gathered."""
    span = slot_span(slots)
    if span is not None:
        return call._grouped(module, x, eg, rows, len(slots), span=span)
    span = slot_span(sorted(slots))
    if span is None:
        return call._grouped(module, x, eg, rows, len(slots))
    perm = torch.argsort(rows, stable=True)  # [S_w] rows in slot order
    xs, es, rs = (t.index_select(0, perm) for t in (x, eg, rows))  # [S_w,H], [S_w], [S_w] in slot order
    proj = call._grouped(module, xs, es, rs, len(slots), span=span)
    return torch.empty_like(proj).index_copy_(0, perm, proj)  # [S_w,H] back in expert order


def slot_span(slots: list[int]) -> tuple[int, int] | None:
    """`(lo, hi)` when a wave's `slots` (in its experts' order) ascend and fill at least half of `lo..hi-1`: the
    grouped call then reads the weights in place (`grouped_experts`' `span`; the unused slots between them are
    empty groups); else None (each expert's weights gathered from its slot)."""
    if not slots or any(b <= a for a, b in zip(slots, slots[1:])):
        return None
    lo, hi = slots[0], slots[-1] + 1
    return (lo, hi) if hi - lo <= 2 * len(slots) else None
