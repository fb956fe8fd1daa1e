"""How a forward drives the expert store: a layer's provider (`LayerExperts`) and the wrapper
(`StreamedMoE`) that, before a MoE layer runs, reads its routing, predicts the next layer's and
brings both in.

Per MoE layer i, `StreamedMoE` routes once and reads the routing on the host (one sync per
streamed layer on CUDA, shared with the prediction's), then (1) applies layer i+1's router to
layer i's FFN input (pre-gating: consecutive layers' hidden states are close, so this predicts
most of i+1's experts) and prefetches the prediction (while such prefetches are being used:
`ExpertStore.predict`); (2) loads layer i's routed experts that
are missing (those the host tier holds as copies queued on the compute stream, the others in
parallel; `ExpertStore.load`), starting the prediction's prefetch once these loads have
started; (3) runs the layer on that routing (`SparseMoE.forward_routed`). In a
verify pass of drafted tokens the same prediction covers the union of the drafted tokens'
experts. The cost over a resident layer: the prediction's router matmul and the sync.

How (3) runs, off the CPU (`fused_moe_path`):
- the routed experts fit the layer's slots: they are loaded and pinned, and one
  `ops.moe_forward` reads them through the slot table: the fused kernel on the same bytes as a
  resident layer's, so the same result bit for bit;
- they do not (small budgets): tokens are split into groups whose experts fit (`split_tokens`)
  and each group's experts are pinned in turn for a pass of the fused kernel over all T rows
  (the other rows routed to one of the group's experts and discarded), keeping the rows of the
  group. The kernel's rows do not depend on each other for a fixed T (`moe_rows_independent`),
  so this is the one-pass result, bit for bit, at the price of experts used by several groups
  being loaded once per group; past `EXACT_USES_PER_EXPERT` uses per routed expert (long
  prefills), and where the kernel does not run, the per-expert path (`weights(e)`) runs.
On the CPU the layer runs expert by expert, as a resident layer does there.

On CUDA a decode step of up to `StreamedMoE.graph_tokens` tokens (its routed experts always fit
the slots) runs as a chain of CUDA graphs cut at each streamed layer's host read
(`runner/piecewise.py`): the routing is copied into pinned memory inside a piece, the host work
above runs between pieces, and the next piece runs the fused call (`StreamedMoE._captured`).

Letters: T tokens, H hidden size, E experts, k experts per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from moestream.layers import moe as moe_layer
from moestream.runner import piecewise
from moestream.weights.qtensor import QTensor

if TYPE_CHECKING:
    from moestream.experts.store import ExpertStore
    from moestream.experts.tiers import ExpertViews

# Token-group passes may use (pin, loading where missing) each routed expert this many times
# on average before the per-expert path is cheaper in loads.
EXACT_USES_PER_EXPERT = 8.0

# Rows of the pinned buffer a captured layer copies its routing into: the most tokens a graph
# of a streamed layer takes (runner/cuda_graph.BUCKETS tops at 32).
GRAPH_ROWS = 256


def split_tokens(
    token_experts: Sequence[Sequence[int]], n_slots: int, max_uses: float | None = None
) -> list[tuple[list[int], list[int]]] | None:
    """Tokens in groups whose experts fit `n_slots` slots: (tokens, sorted experts) per group,
    each token in the first group it fits (token order). None when the groups' expert counts
    would add up to more than `max_uses`. Raises ValueError for a token with more experts than
    slots."""
    groups: list[tuple[list[int], int]] = []  # (tokens, expert bit mask)
    uses = 0
    for t, experts in enumerate(token_experts):
        mask = 0
        for e in experts:
            mask |= 1 << int(e)
        if mask.bit_count() > n_slots:
            raise ValueError(f"token {t} uses {mask.bit_count()} experts, {n_slots} slots")
        for i, (tokens, union) in enumerate(groups):
            grown = union | mask
            if grown.bit_count() <= n_slots:
                tokens.append(t)
                groups[i] = (tokens, grown)
                uses += grown.bit_count() - union.bit_count()
                break
        else:
            groups.append(([t], mask))
            uses += mask.bit_count()
        if max_uses is not None and uses > max_uses:
            return None
    return [(tokens, [e for e in range(union.bit_length()) if union >> e & 1])
            for tokens, union in groups]  # fmt: skip


class LayerExperts:
    """The `ExpertProvider` of one layer of an `ExpertStore`.

    `weights(e)` returns views of e's device slot, loading it first on a miss; the views stay
    valid until the next `weights` call of this layer or `end()` (the expert is pinned until
    then). `begin(token_experts)` / `end()` bracket a forward: begin loads the routed experts
    (as many as the slots hold) in parallel, pinning them for a fused kernel when asked. For a
    fused kernel, `acquire(experts)` pins them all and returns the device-side `expert_slot`
    table over `stacked()`; `release()` unpins. Counting: each routed expert of a forward is
    one device hit or miss, counted where it is found or loaded; a token-group pass counts its
    group's experts again (each pass needs them in place).
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
    def begin(
        self,
        token_experts: Sequence[Sequence[int]],
        load: Sequence[int] | None = None,
        pin: bool = False,
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        """A forward of this layer starts with this routing (each token's experts): counts it,
        records it (eviction and promotion policies) and loads `load` (default: the routed
        experts; as many as the slots hold unless `pin`), counting hits, misses and the stall.
        With `pin` (at most n_slots experts) `load` stays pinned until `release()` or `end()`,
        and `expert_slot` maps it: the operands of a fused kernel. `meanwhile` runs once the
        loads have started (`ExpertStore.load`)."""
        routed_set = {int(e) for experts in token_experts for e in experts}
        routed = sorted(routed_set)
        store = self.store
        tokens = {"tokens": len(token_experts)} if self.layer == 0 else {}
        store.account_prediction(self.layer, routed_set, **tokens)
        self._in_forward = True
        if store.cuda:  # loads order their copies after the work queued on this stream
            store.compute_stream = torch.cuda.current_stream(store.device)
        if self.fully_resident:
            store.counters.add(device_hits=len(routed))
            if meanwhile is not None:
                meanwhile()
            return
        with self.tier.cond:
            self._pending = routed_set
        if load is None:  # pinned: all of them (they must fit); else as many as fit
            first = routed if pin else routed[: self.tier.n_slots]
        else:
            first = sorted({int(e) for e in load})
        if pin and len(first) > self.tier.n_slots:
            raise ValueError(f"{len(first)} experts do not fit {self.tier.n_slots} slots")
        store.load(self.layer, first, keep=routed, pin=pin, meanwhile=meanwhile)
        if pin:
            self._acquired += first
        store.record(self.layer, token_experts)  # after the pins: promotions cannot evict them

    def end(self) -> None:
        """The forward is over (its work enqueued): every pin it held is released."""
        with self.tier.cond:
            self._unpin_current()
            self._pending = set()
            self._release_locked()
        self._in_forward = False

    # ---- fused-kernel path -------------------------------------------------------------------
    def acquire(self, experts: Sequence[int]) -> torch.Tensor:
        """Load and pin `experts` (at most n_slots distinct; the missing ones in parallel,
        counted as hits, misses and the stall); the `expert_slot` table [E] int32 (-1 where
        absent) on the device, current for them. Pair with `release()`.

        When to release: as soon as the work that reads the slots is enqueued on the current
        stream, not when it has run. A load that later takes one of the slots claims it first,
        and its copy waits for an event recorded on the compute stream at the claim (after
        that work), so it never overwrites a slot that queued work still reads."""
        want = sorted({int(e) for e in experts})
        if len(want) > self.tier.n_slots:
            raise ValueError(f"{len(want)} experts do not fit {self.tier.n_slots} slots")
        if self.store.cuda:
            self.store.compute_stream = torch.cuda.current_stream(self.store.device)
        if not self.fully_resident:
            self.store.load(self.layer, want, keep=set(want) | self.pending_snapshot(), pin=True)
            self._acquired += want
        return self.expert_slot

    def release(self) -> None:
        """Unpin what `acquire` (and `begin(pin=True)`) pinned (see `acquire` for when)."""
        with self.tier.cond:
            self._release_locked()

    def _release_locked(self) -> None:
        if self._acquired:
            self.tier.dir.unpin_all(self._acquired)
            self._acquired = []
            self.tier.cond.notify_all()

    @property
    def expert_slot(self) -> torch.Tensor:
        """expert -> slot [E] int32 on the device (-1: not in a slot); see `refresh_table`."""
        return self.refresh_table()

    def refresh_table(self) -> torch.Tensor:
        """The `expert_slot` table, first copied from the host mirror if that changed (a
        non-blocking copy on CUDA, on the caller's stream, so queued kernels read the table as
        it was when they were enqueued). The entries of pinned experts stay valid."""
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
    """A MoE layer (layers/moe.SparseMoE) run through the store (module doc): routed once on
    the device, the routing read on the host, the next layer's experts predicted and
    prefetched, this layer's loaded in one batch, then the layer's experts run on that routing.
    Attribute reads and `experts` assignment go to the wrapped layer, so code that inspects
    `model.moe_layers()` keeps working. `paths` counts forwards by how they ran: "fused" (one
    kernel over pinned slots), "passes" (token-group passes), "per_expert"."""

    def __init__(
        self,
        moe: Any,
        experts: LayerExperts,
        next_router: QTensor | None,
        exact_uses_per_expert: float = EXACT_USES_PER_EXPERT,
    ):
        self.__dict__["moe"] = moe
        self.__dict__["provider"] = experts
        self.__dict__["next_router"] = next_router
        self.__dict__["exact_uses_per_expert"] = exact_uses_per_expert
        self.__dict__["paths"] = {"fused": 0, "passes": 0, "per_expert": 0}

    @property
    def capturable(self) -> bool:
        """Never as one graph: the forward reads the routing on the host. A chain of graphs
        cut at that read can (`graph_tokens`, runner/piecewise.py)."""
        return False

    @property
    def graph_tokens(self) -> int:
        """The most tokens a forward can take inside a chain of graphs (runner/piecewise.py):
        its routed experts always fit the layer's slots there (one fused kernel over pinned
        slots, the same as eager); 0 where that path cannot run (the CPU, kernels that do not
        take the experts' types)."""
        moe, provider = self.moe, self.provider
        if not provider.store.cuda or not moe_layer.graphable_experts(
            moe.router, provider.stacked()
        ):
            return 0
        if provider.fully_resident:
            return 1 << 30
        return provider.n_slots // moe.top_k

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H], exactly what the wrapped layer computes."""
        moe = self.moe
        weights, ids = moe_layer.route(
            x, moe.router, moe.top_k, moe.norm_topk_prob, moe.route_counters
        )  # [T, k]
        both = ids
        if self.next_router is not None:
            _, next_ids = moe_layer.route(
                x, self.next_router, moe.top_k, moe.norm_topk_prob, self._prediction_counters(x)
            )
            both = torch.cat([ids, next_ids], dim=1)  # [T, 2k]: one host read for both
        cutter = piecewise.active()
        if cutter is not None:
            return self._captured(cutter, x, weights, ids, both)
        if x.is_cuda:
            self._rows_buffer(both)  # made here, outside any capture (a graph copies into it)
        token_experts, predict = self._host_rows(both.tolist())
        try:
            return self._forward(x, weights, ids, token_experts, predict)
        finally:
            self.provider.end()  # the work is enqueued: the pins may go (LayerExperts.acquire)

    def _prediction_counters(self, x: torch.Tensor) -> Any:
        """The prediction's router arrival counters (the layer's own router has
        `moe.route_counters`), made once, outside any capture: a graph replays with them."""
        if "prediction_counters" not in self.__dict__:
            made = None
            if self.moe.route_counters is not None:
                from moestream.kernels.router import route_counters

                made = route_counters(x.device)
            self.__dict__["prediction_counters"] = made
        return self.__dict__["prediction_counters"]

    def _rows_buffer(self, both: torch.Tensor) -> torch.Tensor:
        """Pinned host rows for `both` [T, c] (a view of one buffer of GRAPH_ROWS rows, made
        on the first call, which is never a capture: the warm-up run precedes it)."""
        buf = self.__dict__.get("rows")
        if buf is None or buf.shape[1] != both.shape[1]:
            if both.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the routing's host buffer must exist before a capture")
            buf = torch.empty(
                (GRAPH_ROWS, both.shape[1]), dtype=both.dtype, pin_memory=both.is_cuda
            )
            self.__dict__["rows"] = buf
        if both.shape[0] > buf.shape[0] or both.dtype != buf.dtype:
            raise RuntimeError(f"routing of {tuple(both.shape)} does not fit the host buffer")
        return buf[: both.shape[0]]

    def _host_rows(
        self, rows: list[list[int]]
    ) -> tuple[list[list[int]], Callable[[], None] | None]:
        """Each token's routed experts from the rows read on the host (routed, then predicted
        when there is a next router), and the prediction's prefetch to start once this layer's
        own loads have (so that its copies do not go ahead of them; None: no next router)."""
        if self.next_router is None:
            return rows, None
        k, store, layer = self.moe.top_k, self.provider.store, self.provider.layer + 1
        predicted = {e for r in rows for e in r[k:]}
        return [row[:k] for row in rows], lambda: store.predict(layer, predicted)

    def _captured(
        self,
        cutter: Any,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        both: torch.Tensor,
    ) -> torch.Tensor:
        """The forward inside a chain of graphs: the routing goes to pinned host memory, the
        piece ends; at replay the host reads it, loads and pins the routed experts and updates
        the slot table (`before`), the next piece runs the fused kernel over the pinned slots,
        then the pins go (`after`). The same kernels on the same operands as `_forward`'s fused
        path, so the same bits."""
        provider, paths = self.provider, self.paths
        if x.shape[0] > self.graph_tokens:
            raise RuntimeError(
                f"{x.shape[0]} tokens exceed layer {provider.layer}'s graph limit "
                f"({self.graph_tokens}): its routed experts might not fit its slots"
            )
        rows = self._rows_buffer(both)
        rows.copy_(both, non_blocking=True)

        def before() -> None:
            if provider.store.cuda:  # the piece's copy of the routing has landed
                torch.cuda.current_stream(provider.store.device).synchronize()
            token_experts, predict = self._host_rows(rows.tolist())
            try:  # every routed expert loaded and pinned (they fit: `graph_tokens`)
                provider.begin(token_experts, pin=True, meanwhile=predict)
            except BaseException:  # a failed read: the step fails, the layer's state is reset
                provider.end()
                raise
            paths["fused"] += 1
            provider.refresh_table()  # queued before the next piece, which reads it

        cutter.cut(before, provider.end)
        return self.moe.forward_routed(x, weights, ids, provider._expert_slot)

    def _forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        token_experts: list[list[int]],
        predict: Callable[[], None] | None,
    ) -> torch.Tensor:
        moe, provider, paths = self.moe, self.provider, self.paths
        routed = {e for experts in token_experts for e in experts}
        if moe_layer.fused_moe_path(x) and not provider.fully_resident:
            if len(routed) <= provider.n_slots:
                provider.begin(token_experts, pin=True, meanwhile=predict)
                paths["fused"] += 1
                return moe.forward_routed(x, weights, ids, provider.expert_slot)
            groups = None
            if moe_layer.moe_rows_independent(x, *provider.stacked()):
                max_uses = self.exact_uses_per_expert * len(routed)
                groups = split_tokens(token_experts, provider.n_slots, max_uses)
            if groups is not None:
                provider.begin(token_experts, load=groups[0][1], pin=True, meanwhile=predict)
                paths["passes"] += 1
                return self._passes(x, weights, ids, groups)
        provider.begin(token_experts, meanwhile=predict)
        fused = provider.fully_resident and moe_layer.fused_moe_path(x)  # the layer's own table
        paths["fused" if fused else "per_expert"] += 1
        return moe.forward_routed(x, weights, ids)

    def _passes(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        groups: list[tuple[list[int], list[int]]],
    ) -> torch.Tensor:
        """One fused pass over all T rows per token group (module doc); the first group's
        experts were pinned by `begin`."""
        provider = self.provider
        out = None
        for n, (tokens, experts) in enumerate(groups):
            table = provider.expert_slot if n == 0 else provider.acquire(experts)
            mask = torch.zeros(x.shape[0], dtype=torch.bool)
            mask[tokens] = True
            in_group = mask.to(x.device)[:, None]  # [T, 1]
            group_ids = torch.where(in_group, ids, experts[0])  # [T, k] only pinned experts
            y = self.moe.forward_routed(x, weights, group_ids, table)  # [T, H]
            out = y if out is None else torch.where(in_group, y, out)
            provider.release()  # this pass is enqueued; later loads wait for it
        assert out is not None
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["moe"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.moe, name, value)
