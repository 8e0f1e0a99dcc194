"""Expert-parallel experts: the `moeflow-ep` experts implementation, one rank of a torch.distributed group.

`ExpertParallel(model, placement)` (a context manager) keeps on this rank only the experts the placement
gives it (the stacked `[E, ...]` parameters are replaced by `[E_r, ...]` shards; the non-expert weights
stay whole on every rank), registers `moeflow-ep` in transformers' experts interface, tags each experts
module with its layer and this object and switches the model to it (`moeflow.moe.experts_impl`, as the
offload engine). Every rank runs the same forward on the same (replicated) batch; only the routed experts are
distributed. One experts call of MoE layer l, on every rank at once:

1. route (no communication): the rows `S = T*k` sorted by expert id exactly as transformers' `grouped_mm`
   sorts them (`moeflow.moe.compute.sort_routing`); the owner of every expert for this call
   (`Placement.assign`: a duplicated expert's rows all go to its least-loaded replica). Rank r is the source
   of the tokens of its contiguous slice `[T*r/N, T*(r+1)/N)`.
2. dispatch: `all_to_all_single` of the row counts (checked against the counts this rank expects: ranks
   that diverged fail loudly), then of the rows `[n, H]` themselves.
3. compute: the received rows, put back in the global sorted order, through the offload engine's grouped
   compute (`moeflow.moe.compute.grouped_experts`) over this rank's shard, one group per routed local
   expert. Each expert's group
   holds exactly the rows, in exactly the order, it has in the single-process call, so the result is
   bit-identical to stock `grouped_mm`.
4. combine: `all_to_all_single` of the results back to their source ranks; each source applies the
   routing weights and sums its tokens' top-k rows as stock does (`moeflow.moe.compute.combine`).
5. gather: an all-gather of the tokens' outputs, so every rank holds the layer output of the whole batch
   (the replicated attention of the next layer needs it).

Per layer it accumulates the wall time of dispatch (2), compute (3), combine (4) and gather (5), and the
rows each rank computed. On CUDA each phase ends with a device synchronization so the times are real.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from ..moe import get_adapter
from ..moe.compute import Aranges, combine, grouped_experts, sort_routing
from ..moe.experts_impl import check_replaceable, use_experts_impl
from .placement import Placement

if TYPE_CHECKING:
    from transformers import PreTrainedModel

IMPL_NAME = "moeflow-ep"
PHASES = ("dispatch", "compute", "combine", "gather")


@dataclass
class EPLayerStats:
    """One MoE layer on one rank, summed over experts calls."""

    calls: int = 0
    dispatch_s: float = 0.0
    compute_s: float = 0.0
    combine_s: float = 0.0
    gather_s: float = 0.0
    rows: int = 0  # (token, expert) rows this rank computed
    sent: int = 0  # rows this rank sent to other ranks (dispatch)
    rows_by_rank: list[int] = field(default_factory=list)  # rows every rank computed (known to all)

    def to_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "dispatch_s": self.dispatch_s,
            "compute_s": self.compute_s,
            "combine_s": self.combine_s,
            "gather_s": self.gather_s,
            "rows": self.rows,
            "sent": self.sent,
            "rows_by_rank": list(self.rows_by_rank),
        }


@dataclass
class _Shard:
    experts: list[int]  # the experts of this layer this rank holds, ascending
    local: torch.Tensor  # [E] long: local index of each expert held here, -1 elsewhere
    weights: dict[str, torch.Tensor]  # the experts module's per-expert parameters, this rank's shard [E_r, ...]


class ExpertParallel:
    """This rank's part of an expert-parallel model (see the module docstring)."""

    def __init__(self, model: nn.Module, placement: Placement, *, group: Any = None):
        self.adapter = get_adapter(model)
        check_replaceable(model, self.adapter, IMPL_NAME, "expert-parallel execution")
        if not dist.is_initialized():
            raise RuntimeError("ExpertParallel needs torch.distributed initialised (init_process_group)")
        self.model = cast("PreTrainedModel", model)
        self.spec = self.adapter.spec
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if placement.world_size != self.world:
            raise ConfigError(f"the placement is for {placement.world_size} ranks, the process group has {self.world}")
        if placement.num_experts != self.spec.num_experts:
            raise ConfigError(f"the placement has {placement.num_experts} experts per layer, the model {self.spec.num_experts}")
        self.placement = placement
        self.device = next(model.parameters()).device
        self.stats: dict[int, EPLayerStats] = {l: EPLayerStats() for l in self.spec.moe_layers}
        self.shards: dict[int, _Shard] = {}
        self.enabled = True  # False: skip nothing, just stop timing (kept for symmetry)
        self._stack: contextlib.ExitStack | None = None
        self._aranges = Aranges()

    # ---- lifecycle ------------------------------------------------------------------------------------
    def __enter__(self) -> ExpertParallel:
        self.attach()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def attach(self) -> None:
        """Shard the experts (irreversible: the other ranks' experts are freed) and switch to `moeflow-ep`."""
        if self._stack is not None:
            return
        stack = contextlib.ExitStack()
        E = self.spec.num_experts
        for l in self.spec.moe_layers:
            experts = self.placement.experts_of(l, self.rank)
            local = torch.full((E,), -1, dtype=torch.long, device=self.device)
            if experts:
                local[torch.tensor(experts, device=self.device)] = torch.arange(len(experts), device=self.device)
            ex = self.adapter.experts(l)
            idx = torch.tensor(experts, dtype=torch.long, device=self.device)
            weights: dict[str, torch.Tensor] = {}
            for name, p in self.adapter.per_expert_params(l).items():
                shard = nn.Parameter(p.detach().index_select(0, idx).contiguous(), requires_grad=False)  # [E_r, ...]
                setattr(ex, name, shard)
                weights[name] = shard
            self.shards[l] = _Shard(experts, local, weights)
        stack.enter_context(use_experts_impl(self.model, self.adapter, IMPL_NAME, self))
        self._stack = stack

    def close(self) -> None:
        """Untag the modules and restore the experts implementation name (the shards stay: reload to undo)."""
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()

    def reset_stats(self) -> None:
        self.stats = {l: EPLayerStats() for l in self.spec.moe_layers}

    def held_experts(self) -> dict[int, list[int]]:
        return {l: list(s.experts) for l, s in self.shards.items()}

    # ---- helpers -----------------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _bounds(self, T: int) -> list[int]:
        """Token slice of each source rank: rank r sends tokens [b[r], b[r+1])."""
        return [T * r // self.world for r in range(self.world + 1)]

    # ---- the experts call ------------------------------------------------------------------------------
    def experts_forward(
        self, module: nn.Module, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        N, me = self.world, self.rank
        st = self.stats[layer]
        shard = self.shards[layer]
        T, H = hidden_states.shape
        k = top_k_index.size(-1)
        E = self.spec.num_experts
        dev = hidden_states.device

        # 1. route: the stock sort, the owners, the sources (identical on every rank)
        expert_ids_g, perm = sort_routing(top_k_index)  # [S], [S] same order as grouped_mm
        counts = torch.bincount(expert_ids_g, minlength=E).tolist()  # the one host read per call
        owner_list = self.placement.assign(layer, counts)
        owner = torch.tensor(owner_list, dtype=torch.long, device=dev)  # [E]
        dst_g = owner[expert_ids_g]  # [S] owner rank of each sorted row
        tok_g = perm // k  # [S] token of each sorted row
        bounds = self._bounds(T)
        src_g = torch.bucketize(tok_g, torch.tensor(bounds[1:-1], dtype=tok_g.dtype, device=dev), right=True)  # [S]
        rows_by_rank = [0] * N
        for e, c in enumerate(counts):
            rows_by_rank[owner_list[e]] += c
        pair = src_g * N + dst_g  # [S] (source, destination) of each row
        pair_counts = torch.bincount(pair, minlength=N * N).view(N, N)  # [src, dst]
        send_counts = pair_counts[me].tolist()  # rows this rank sends to each destination
        expect_recv = pair_counts[:, me].tolist()  # rows this rank receives from each source

        # rows this rank sends, grouped by destination, in sorted order inside each destination
        mine = torch.nonzero(src_g == me).squeeze(1)  # [n_mine] sorted positions
        send_pos = mine[torch.sort(dst_g[mine], stable=True)[1]]  # [n_mine]
        # rows this rank receives: sources in rank order, sorted order inside each source
        theirs = torch.nonzero(dst_g == me).squeeze(1)  # [n_recv] sorted positions, ascending
        recv_pos = theirs[torch.sort(src_g[theirs], stable=True)[1]]  # [n_recv] in arrival order
        x_send = hidden_states[tok_g[send_pos]]  # [n_mine, H]

        # 2. dispatch
        t0 = time.perf_counter()
        cnt_in = torch.tensor(send_counts, dtype=torch.long, device=dev)
        cnt_out = torch.empty(N, dtype=torch.long, device=dev)
        dist.all_to_all_single(cnt_out, cnt_in, group=self.group)
        got = cnt_out.tolist()
        if got != expect_recv:
            raise RuntimeError(
                f"rank {me} layer {layer}: ranks disagree on the routing (expected {expect_recv} rows, got {got}); "
                "every rank must run the same model on the same batch"
            )
        x_recv = hidden_states.new_empty(sum(got), H)  # [n_recv, H]
        dist.all_to_all_single(x_recv, x_send, output_split_sizes=got, input_split_sizes=send_counts, group=self.group)
        self._sync()
        t1 = time.perf_counter()

        # 3. compute, in the global sorted order
        order = torch.argsort(recv_pos)  # arrival index of each row, in sorted-position order
        eg = expert_ids_g[recv_pos[order]]  # [n_recv] ascending expert ids
        local = shard.local[eg]  # [n_recv] ascending indices into the shard
        groups = min(local.numel(), len(shard.experts))  # >= the routed local experts
        y = grouped_experts(module, x_recv[order], local, shard.weights, local, groups, self._aranges)  # [n_recv, H]
        y_back = torch.empty_like(y)
        y_back[order] = y  # arrival order again
        self._sync()
        t2 = time.perf_counter()

        # 4. combine: results back to their sources, then the stock weighting and top-k sum
        out_mine = y_back.new_empty(len(send_pos), y_back.shape[-1])  # [n_mine, H]
        dist.all_to_all_single(out_mine, y_back, output_split_sizes=send_counts, input_split_sizes=got, group=self.group)
        t0_tok, t1_tok = bounds[me], bounds[me + 1]
        mine_out = combine(
            out_mine, perm[send_pos], top_k_weights.reshape(-1), t1_tok - t0_tok, k, hidden_states.dtype, first_token=t0_tok
        )  # [T_r, H] as stock: proj * w, (token, slot) order, summed over k
        self._sync()
        t3 = time.perf_counter()

        # 5. gather: every rank gets the whole batch's output
        M = max(bounds[r + 1] - bounds[r] for r in range(N))
        padded = mine_out.new_zeros(M, H)
        padded[: t1_tok - t0_tok] = mine_out
        parts = [torch.empty_like(padded) for _ in range(N)]
        dist.all_gather(parts, padded, group=self.group)
        out = torch.cat([parts[r][: bounds[r + 1] - bounds[r]] for r in range(N)], dim=0)  # [T, H]
        self._sync()
        t4 = time.perf_counter()

        st.calls += 1
        st.dispatch_s += t1 - t0
        st.compute_s += t2 - t1
        st.combine_s += t3 - t2
        st.gather_s += t4 - t3
        st.rows += len(recv_pos)
        st.sent += sum(c for d, c in enumerate(send_counts) if d != me)
        if not st.rows_by_rank:
            st.rows_by_rank = [0] * N
        for r in range(N):
            st.rows_by_rank[r] += rows_by_rank[r]
        return out
