"""Host expert store: every routed expert's weights in ONE contiguous host buffer, so one copy moves one expert.

`HostExpertStore` keeps, per MoE layer, a `[E, row_numel]` host tensor whose row e is expert e, in the
flat row layout of `moeflow.moe.layout.ExpertLayout` (every per-expert parameter at a 64-byte aligned offset).
On a CUDA target the rows are pinned so copies can run asynchronously on a side stream; where the host cannot
page-lock that much memory (WSL2, a capped container) they stay pageable and `pin_error` says why (`moeflow run`
prints it as a warning and its JSON has `host_memory`).

`offload(model)` moves the stacked parameters into the store and replaces them on the device by
empty tensors (the memory is really freed); `restore()` puts them back bit for bit.

Mixed precision (`quantize(bits)`, after `offload`): per precision (int8/int4/int2) and layer a
`[E, compact_bytes]` uint8 host tensor of HQQ-packed codes + float16 scales/zeros (`moeflow.quant`),
pinned like the full rows. A low-precision transfer moves `compact_row(layer, expert, bits)` (its
bytes, `expert_bytes_at(bits)`, are what the link and the cache count) into the first bytes of the
slot's full row, and `dequantize(bits, slot_row)` then rebuilds the model-dtype row in place on the
device, so the slot buffer and the engine's grouped GEMM stay the same for every precision.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..moe.adapters import Adapter
from ..moe.layout import ALIGN_BYTES, ExpertLayout, ParamSlice  # noqa: F401  (importable from here too)
from ..quant import FULL, CompactLayout, dequantize_row, quantize_rows


def _alloc_pinned(shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
    """Zeros of `shape` in page-locked host memory (raises RuntimeError where the host cannot lock that much)."""
    return torch.zeros(shape, dtype=dtype, pin_memory=True)


def _pin_copy(t: torch.Tensor) -> torch.Tensor:
    """A page-locked copy of `t` (raises RuntimeError where the host cannot lock that much)."""
    return t.pin_memory()


def pin_failure(err: BaseException) -> str:
    """One line for a host allocation that could not be page-locked (the store then keeps pageable rows)."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (
        f"host memory for the experts could not be page-locked ({first}); they stay in pageable memory, so every "
        "copy to the device is staged and synchronous (slower than a calibration measured with pinned copies). "
        "Free host memory, or raise the page-locked limit (WSL2 and some containers cap it)"
    )


class HostExpertStore:
    """Per MoE layer a `[E, row_numel]` host tensor; `row(layer, expert)` is one expert's contiguous buffer."""

    def __init__(self, adapter: Adapter, *, pin: bool):
        self.adapter = adapter
        self.spec = adapter.spec
        self.pin = pin
        first = adapter.per_expert_params(self.spec.moe_layers[0])
        self.layout = ExpertLayout.of({n: p.detach() for n, p in first.items()})
        self.rows: dict[int, torch.Tensor] = {}
        self.row_views: dict[int, list[torch.Tensor]] = {}  # layer -> its rows' views `[R]` (made once, at offload)
        self._params: dict[int, dict[str, torch.nn.Parameter]] = {}
        self._device: dict[int, torch.device] = {}
        self.offloaded = False
        self.compact: dict[int, dict[int, torch.Tensor]] = {}  # bits -> layer -> [E, compact bytes] uint8
        self.compact_layout: dict[int, CompactLayout] = {}
        self.pin_error: str | None = None  # why the rows are pageable although `pin` asked for pinned ones (`pin_failure`)

    def _pinned(self, t: torch.Tensor | None = None, shape: tuple[int, ...] = (), dtype: torch.dtype | None = None):
        """`t` pinned (or, without `t`, zeros of `shape` and `dtype` allocated pinned) where `pin` asks for it; pageable
        when page-locking fails (`pin_error` says why; no later allocation tries again). `pin` is a CUDA engine's."""
        if self.pin and self.pin_error is None:
            try:
                return _alloc_pinned(shape, dtype) if t is None else _pin_copy(t)
            except RuntimeError as err:  # cudaHostAlloc refused (too much to page-lock here), or no CUDA runtime
                self.pin_error = pin_failure(err)
        return torch.zeros(shape, dtype=dtype) if t is None else t

    @property
    def expert_bytes(self) -> int:
        """Bytes one transfer moves (the padded row; padding is at most 64 bytes per parameter)."""
        return self.layout.row_bytes

    def row(self, layer: int, expert: int) -> torch.Tensor:
        return self.row_views[layer][expert]  # [row_numel] contiguous

    # ---- mixed precision -------------------------------------------------------------------------
    @property
    def precisions(self) -> tuple[int, ...]:
        """Low precisions held (bits, ascending), besides the full-precision rows."""
        return tuple(sorted(self.compact))

    def quantize(self, bits, *, optimize: bool = True) -> None:
        """Make the compact copies of every expert at each precision of `bits` (once; needs `offload` first)."""
        if not self.offloaded:
            raise RuntimeError("HostExpertStore.quantize needs the experts in the store: call offload() first")
        for b in sorted(set(int(x) for x in bits) - {FULL}):
            if b in self.compact:
                continue
            self.compact_layout[b] = CompactLayout.of(self.layout, b)
            self.compact[b] = {}
            for l, rows in self.rows.items():
                q = quantize_rows(self.layout, rows, b, optimize=optimize)
                self.compact[b][l] = self._pinned(q)

    def expert_bytes_at(self, bits: int) -> int:
        """Bytes one transfer of an expert at `bits` moves (`FULL`: the full row)."""
        return self.expert_bytes if bits == FULL else self.compact_layout[bits].row_bytes

    def compact_row(self, layer: int, expert: int, bits: int) -> torch.Tensor:
        """The host bytes a transfer at `bits` moves: `[compact bytes]` uint8 (`FULL`: the full row)."""
        return self.row(layer, expert) if bits == FULL else self.compact[bits][layer][expert]

    def landing(self, slot_row: torch.Tensor, bits: int) -> torch.Tensor:
        """Where a transfer at `bits` lands in a slot's full row `[row_numel]`: its first compact bytes as uint8."""
        if bits == FULL:
            return slot_row
        return slot_row.view(torch.uint8)[: self.compact_layout[bits].row_bytes]

    def dequantize(self, bits: int, slot_row: torch.Tensor) -> None:
        """Rebuild, in place on its device, the model-dtype row from the compact bytes a transfer left in it."""
        dequantize_row(self.compact_layout[bits], self.landing(slot_row, bits), self.layout, slot_row)

    def offload(self) -> None:
        """Copy every layer's stacked experts into host rows and free them on the device (rows an earlier store left
        the parameters in are taken as they are: `_rows_of`)."""
        if self.offloaded:
            return
        E = self.spec.num_experts
        for l in self.spec.moe_layers:
            params = self.adapter.per_expert_params(l)
            if set(params) != {p.name for p in self.layout.params}:
                raise ConfigError(f"layer {l} has expert parameters {sorted(params)}, unlike the first MoE layer")
            host = self._rows_of(params)  # [E,R]: the rows an earlier engine left the parameters in, or None
            if host is None:  # pinned from the start where it will be pinned: one copy from the device, no second
                host = self._pinned(shape=(E, self.layout.row_numel), dtype=self.layout.dtype)  # [E,R]
                views = self.layout.views(host)
                with torch.no_grad():
                    for name, p in params.items():
                        if p.device.type == "cpu":
                            views[name].copy_(p.detach())  # one strided host copy
                        else:  # per expert: contiguous on both sides, so the device copies straight into the rows
                            for e, row in enumerate(views[name].unbind(0)):  # (a strided view would be staged first)
                                row.copy_(p.detach()[e])
            elif self.pin and not host.is_pinned():
                host = self._pinned(host)
            self.rows[l] = host
            self.row_views[l] = list(self.rows[l].unbind(0))  # [R] each: a copy's source, no view made per copy
            self._params[l] = dict(params)
            self._device[l] = next(iter(params.values())).device
            for p in params.values():  # free the device copy; keep the Parameter object
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.offloaded = True

    def _rows_of(self, params: dict[str, torch.nn.Parameter]) -> torch.Tensor | None:
        """The `[E, R]` host rows `params` are views of, laid out as this store's rows, when an earlier store's
        `restore` left them so (host-loaded experts beside a CUDA device): the next engine takes them as they are
        instead of copying every expert again (and pinning the copy). None otherwise (a copy is made)."""
        first = next(iter(params.values()))
        if first.device.type != "cpu":
            return None
        E, R = self.spec.num_experts, self.layout.row_numel
        storage = first.untyped_storage()
        if storage.nbytes() != E * R * first.element_size():
            return None
        rows = torch.empty(0, dtype=self.layout.dtype).set_(storage, 0, (E, R), (R, 1))  # [E,R] over that storage
        views = self.layout.views(rows)
        for name, p in params.items():
            v = views[name]
            if p.untyped_storage().data_ptr() != storage.data_ptr() or p.data_ptr() != v.data_ptr():
                return None
            if p.shape != v.shape or p.stride() != v.stride() or p.dtype != v.dtype:
                return None
        return rows

    def device_numel(self) -> int:
        """Elements the offloaded stacked parameters still hold on their device (0 while offloaded)."""
        return sum(p.numel() for params in self._params.values() for p in params.values())

    def restore(self) -> None:
        """Put the stacked parameters back on their device, bit for bit. Parameters that lived in host memory beside
        a CUDA device (`moeflow run --load-experts host`) become views of the rows (pinned unless page-locking failed),
        not copies: a copy would hold the experts twice in host memory when the engine closes (pinned blocks stay in
        torch's host cache)."""
        if not self.offloaded:
            return
        for l, params in self._params.items():
            views = self.layout.views(self.rows[l])
            in_place = self.pin and self._device[l].type == "cpu"  # host experts of a CUDA engine: keep the rows
            for name, p in params.items():
                p.data = views[name] if in_place else views[name].to(self._device[l], copy=True).contiguous()
        self.rows.clear()
        self.row_views.clear()
        self._params.clear()
        self.compact.clear()
        self.compact_layout.clear()
        self.offloaded = False
