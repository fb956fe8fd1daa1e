"""How a forward drives the expert store: a layer's provider (`LayerExperts`) and the wrapper
(`StreamedMoE`) that, before a MoE layer runs, reads its routing, predicts the next layer's and
brings both in.

Per MoE layer i, `StreamedMoE` (1) applies layer i+1's router to layer i's FFN input (pre-gating:
consecutive layers' hidden states are close, so this predicts most of i+1's experts) and
prefetches the prediction; (2) loads layer i's routed experts that are missing, in parallel;
(3) runs the layer, whose `weights(e)` calls then hit. In a verify pass of drafted tokens the
same prediction covers the union of the drafted tokens' experts. Prediction costs one router
matmul per layer; routing the layer twice (here and in SparseMoE) another; reading the routing
on the host is one sync per streamed layer on CUDA (layers whose experts all fit on the device
are never wrapped and stay sync-free).

Letters: T tokens, H hidden size, E experts, k experts per token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from moestream.layers.moe import route
from moestream.weights.qtensor import QTensor

if TYPE_CHECKING:
    from moestream.experts.store import ExpertStore
    from moestream.experts.tiers import ExpertViews


class LayerExperts:
    """The `ExpertProvider` of one layer of an `ExpertStore`.

    `weights(e)` returns views of e's device slot, loading it first on a miss; the views stay
    valid until the next `weights` call of this layer or `end()` (the expert is pinned until
    then). `begin(token_experts)` / `end()` bracket a forward: begin loads the routed experts
    (as many as the slots hold) in parallel. For a fused kernel, `acquire(experts)` pins them all
    and returns the device-side `expert_slot` table; `release()` unpins.
    """

    def __init__(self, store: ExpertStore, layer: int):
        self.store, self.layer = store, layer
        self.tier = store.device_tiers[layer]
        self.fully_resident = self.tier.n_slots == store.num_experts
        self.table_dirty = True
        self._expert_slot = torch.full(
            (store.num_experts,), -1, dtype=torch.int32, device=store.device
        )  # [E]
        self._current: int | None = None
        self._acquired: list[int] = []
        self._pending: set[int] = set()
        self._in_forward = False

    @property
    def num_experts(self) -> int:
        return self.store.num_experts

    @property
    def n_slots(self) -> int:
        return self.tier.n_slots

    def pending_snapshot(self) -> set[int]:
        """Experts the running forward still needs (eviction avoids them)."""
        with self.tier.cond:
            return set(self._pending)

    # ---- ExpertProvider ----------------------------------------------------------------------
    def weights(self, e: int) -> ExpertViews:
        tier, counters = self.tier, self.store.counters
        if self.fully_resident:
            if not self._in_forward:
                counters.add(device_hits=1)
            return tier.buffers.views(tier.slot_mirror[e])
        with tier.cond:
            self._unpin_current()
            self._pending.discard(e)
            ready, late = tier.dir.is_ready(e), tier.dir.is_mapped(e)
            if ready:
                tier.dir.pin(e)
                self._current = e
                useful = tier.dir.use(e)
                slot = tier.dir.slot_of[e]
        if ready:
            counters.add(device_hits=int(not self._in_forward), prefetch_useful=int(useful))
            return tier.buffers.views(slot)
        start = time.perf_counter()
        slot = self.store._device_ready(self.layer, e, self.pending_snapshot(), pin=True)
        with tier.cond:
            self._current = e
            useful = tier.dir.use(e)
        counters.add(
            device_misses=1, stalls=1, stall_s=time.perf_counter() - start,
            prefetch_useful=int(useful), prefetch_late=int(late),
        )  # fmt: skip
        return tier.buffers.views(slot)

    def _unpin_current(self) -> None:
        if self._current is not None:
            self.tier.dir.unpin(self._current)
            self._current = None
            self.tier.cond.notify_all()

    # ---- forward bracket ---------------------------------------------------------------------
    def begin(self, token_experts: Sequence[Sequence[int]]) -> None:
        """A forward of this layer starts with this routing (each token's experts)."""
        routed = sorted({int(e) for experts in token_experts for e in experts})
        store = self.store
        if self.layer == 0:
            store.counters.add(tokens=len(token_experts))
        store.account_prediction(self.layer, set(routed))
        self._in_forward = True
        if store.cuda:  # evictions order copies after the work queued on this stream
            store.compute_stream = torch.cuda.current_stream(store.device)
        if self.fully_resident:
            store.counters.add(device_hits=len(routed))
            return
        with self.tier.cond:
            self._pending = set(routed)
        store.load(self.layer, routed[: self.tier.n_slots], keep=routed)
        store.record(self.layer, token_experts)

    def end(self) -> None:
        with self.tier.cond:
            self._unpin_current()
            self._pending = set()
        self._in_forward = False

    # ---- fused-kernel path -------------------------------------------------------------------
    def acquire(self, experts: Sequence[int]) -> torch.Tensor:
        """Load and pin `experts` (at most n_slots distinct); the `expert_slot` table [E] int32
        (-1 where absent) on the device, current for them. Pair with `release()`."""
        want = sorted(set(int(e) for e in experts))
        if len(want) > self.tier.n_slots:
            raise ValueError(f"{len(want)} experts do not fit {self.tier.n_slots} slots")
        if self.store.cuda:
            self.store.compute_stream = torch.cuda.current_stream(self.store.device)
        if not self.fully_resident:
            self.store.load(self.layer, want, keep=want)
            for e in want:
                self.store._device_ready(self.layer, e, want, pin=True)
                self._acquired.append(e)
        return self.expert_slot

    def release(self) -> None:
        with self.tier.cond:
            for e in self._acquired:
                self.tier.dir.unpin(e)
            self._acquired = []
            self.tier.cond.notify_all()

    @property
    def expert_slot(self) -> torch.Tensor:
        """expert -> slot [E] int32 on the device (-1: not in a slot); refreshed from the host
        mirror when it changed (a non-blocking copy on CUDA, on the caller's stream)."""
        if self.table_dirty:
            with self.tier.cond:
                mirror = torch.tensor(self.tier.slot_mirror, dtype=torch.int32)
                self.table_dirty = False
            if self.store.cuda:
                mirror = mirror.pin_memory()
            self._expert_slot.copy_(mirror, non_blocking=self.store.cuda)
        return self._expert_slot

    def stacked(self) -> ExpertViews:
        """gate, up [S, F, H], down [S, H, F] over all device slots (fused-kernel operands)."""
        return self.tier.buffers.stacked()


class StreamedMoE:
    """A MoE layer (layers/moe.SparseMoE) run through the store: routing read first, this
    layer's experts loaded in one batch, the next layer's predicted and prefetched. Attribute
    reads and `experts` assignment go to the wrapped layer, so code that inspects
    `model.moe_layers()` keeps working."""

    def __init__(self, moe: Any, experts: LayerExperts, next_router: QTensor | None):
        self.__dict__["moe"] = moe
        self.__dict__["provider"] = experts
        self.__dict__["next_router"] = next_router

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H], exactly what the wrapped layer computes."""
        moe, provider = self.moe, self.provider
        if self.next_router is not None:
            _, next_ids = route(x, self.next_router, moe.top_k, moe.norm_topk_prob)  # [T, k]
            provider.store.predict(provider.layer + 1, set(next_ids.flatten().tolist()))
        _, ids = route(x, moe.router, moe.top_k, moe.norm_topk_prob)  # [T, k]
        provider.begin(ids.tolist())
        try:
            return moe(x)
        finally:
            provider.end()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["moe"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.moe, name, value)
