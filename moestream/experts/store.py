"""`ExpertStore`: every MoE layer's experts in three tiers behind one interface.

Tiers, per layer: device slots (a fixed [S, bytes] buffer per tensor kind; resident experts are
promoted ones that caching does not evict), the host tier (pinned RAM on CUDA, an inclusive cache
of the file) and the GGUF file (positional reads by a pool of threads). `layers[i]` is layer i's
`ExpertProvider` (layers/moe.py): `weights(e)` returns QTensor views of e's device slot, loading
it first on a miss (counted as a stall, with its time).

Loads: a forward's misses that the host tier holds are *queued*: the compute thread claims their
slots and queues their copies on the compute stream itself, ahead of the layer's kernel, and
goes on (the GPU waits for the copies, the thread does not; no hand-off to another thread). The
rest run on the demand pool (disk reads, a forward's misses in parallel) or on the calling
thread; a prefetch (`prefetch`, `predict`) on the prefetch pool, never blocking the caller. A
load claims a slot under the layer's lock (the directory picks the victim), copies outside it and
publishes the expert when its bytes are in place (a queued load: when its copy is queued, which
orders it before every later reader, all of them kernels on the compute stream); whoever needs
the expert meanwhile waits on the layer's condition. A host slot that a queued copy reads is
not overwritten before that copy has run (`HostTier.read` waits for its event). The experts
whose slots the compute thread is enqueueing work on are pinned (one expert's views, or a fused
kernel's whole set), so no concurrent load claims their slots. On CUDA the other copies run on
a side stream that first waits for the compute work queued before the claim (an event
recorded on the compute stream), so pins may be dropped as soon as the work that reads the
slots is enqueued, never waiting for it to run; the I/O thread waits for the copy before
publishing. On the CPU the "device" tier is CPU memory and copies are memcpy.

Errors: a failed read raises `ExpertReadError` (file, layer, expert) in the thread that needs the
expert; a failed prefetch is counted and retried when the expert is demanded.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from moestream.experts.counters import ExpertCounters
from moestream.experts.disk import ExpertFileReader, ExpertReadError
from moestream.experts.placement import ExpertLayout, Placement
from moestream.experts.policy import SlotDirectory, make_policy
from moestream.experts.prefetch import LayerExperts
from moestream.experts.tiers import (
    ExpertViews,
    HostTier,
    SlotBuffers,
    StagingPool,
    TierLayer,
    reraise,
)

_CPU = torch.device("cpu")

# How an I/O thread waits for its copy: spinning in the driver (False), or asleep
# (cudaEventBlockingSync). H200, experts streamed from pinned memory at half the 30B's experts,
# eager decode (nineteenth session, one arm each came back): spinning 9.5 tok/s and a stall of
# 4.25 ms a decode token, asleep 8.1 and 5.09 (a waker's latency on every miss). The decode
# figures with chains of graphs were measured asleep; `gpu_figures.sh s27c` compares the two.
COPY_WAIT_BLOCKING = False
# Demand misses that the host tier holds are queued on the compute stream by the compute thread
# (module doc); False sends them to the demand pool like the disk's (the way before, kept for
# side-by-side timing: `gpu_figures.sh s28a`).
QUEUE_HOST_LOADS = True
# A prediction is prefetched only while the loads it asks for pay: over the last
# PREFETCH_WINDOW experts that predictions named outside the device slots (per phase), at
# least PREFETCH_MIN_USE of them were then routed (measured whether prefetched or not, so the
# gate can reopen). A wasted load costs a copy, an eviction and I/O threads' Python. On the
# trained tiny MoE 84-87% of decode prefetches are used; on a synth 30B's decode 26% (greedy,
# twentieth session), where nearly all it routes is already in slots.
PREFETCH_WINDOW = 512
PREFETCH_MIN_USE = 0.5


class PrefetchUse:
    """Of the last `window` experts that predictions named outside the device slots, how many
    the predicted forward then routed (the share a prefetch of them would have used)."""

    def __init__(self, window: int):
        self.window = window
        self._samples: deque[tuple[int, int]] = deque()  # (named, routed) per prediction
        self.named = self.routed = 0

    def add(self, named: int, routed: int) -> None:
        self._samples.append((named, routed))
        self.named += named
        self.routed += routed
        while self.named - self._samples[0][0] >= self.window:
            n, r = self._samples.popleft()
            self.named -= n
            self.routed -= r

    def pays(self, min_use: float) -> bool:
        """Open until a quarter window is measured, then while the share is >= min_use."""
        return self.named < self.window // 4 or self.routed >= min_use * self.named


class ExpertStore:
    """Experts of all MoE layers of one model file, placed by `placement` (see module doc).

    Options: `policy` (lru | lfu | window) and `window` (tokens) pick the eviction policy of
    both tiers; `resident_fraction` of each streamed layer's device slots hold promoted experts
    (the most frequent over `window` tokens, re-chosen every `rebalance_every` tokens);
    `io_threads` per pool; `direct` opens the file with O_DIRECT.
    """

    def __init__(
        self,
        layout: ExpertLayout,
        placement: Placement,
        device: torch.device | str = "cpu",
        *,
        policy: str = "window",
        window: int = 256,
        resident_fraction: float = 0.25,
        rebalance_every: int = 32,
        io_threads: int = 4,
        direct: bool = False,
        reader: ExpertFileReader | None = None,
    ):
        self.layout, self.placement = layout, placement
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.counters = ExpertCounters()
        self.reader = reader or ExpertFileReader(layout, direct=direct)
        self.num_experts, k = layout.n_experts, layout.top_k
        opts: dict[str, Any] = {"window": window} if policy == "window" else {}
        self.device_tiers: list[TierLayer] = []
        self.host_tiers: list[HostTier | None] = []
        for i, tensors in enumerate(layout.layers):
            s, h = placement.device_slots[i], placement.host_slots[i]
            resident = 0 if s == self.num_experts else min(int(resident_fraction * s), s - k)
            directory = SlotDirectory(
                s, make_policy(policy, self.num_experts, **opts), resident, rebalance_every, window
            )
            self.device_tiers.append(
                TierLayer(SlotBuffers(tensors, s, self.device), directory, self.num_experts)
            )
            host = None
            if h:
                hdir = SlotDirectory(h, make_policy(policy, self.num_experts, **opts))
                buffers = SlotBuffers(tensors, h, _CPU, pin_memory=True)
                host = HostTier(buffers, hdir, self.num_experts)
            self.host_tiers.append(host)
        self.staging = None
        if self.cuda and any(h is None for h in self.host_tiers):
            pinned = placement.staging_bytes > 0
            self.staging = StagingPool(layout.layers, 2 * io_threads + 1, pinned)
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.compute_stream = torch.cuda.current_stream(self.device) if self.cuda else None
        self._demand_pool = ThreadPoolExecutor(io_threads, thread_name_prefix="experts-demand")
        self._prefetch_pool = ThreadPoolExecutor(io_threads, thread_name_prefix="experts-prefetch")
        self._predicted: list[set[int] | None] = [None] * layout.n_layers
        self._predicted_out: list[set[int] | None] = [None] * layout.n_layers  # not in slots
        self._prefetch_uses: dict[str, PrefetchUse] = {}  # per phase
        self._inflight: list[Future[None]] = []
        self._inflight_lock = threading.Lock()
        self.layers = [LayerExperts(self, i) for i in range(layout.n_layers)]
        self.warm([i for i in range(layout.n_layers) if self.layers[i].fully_resident])

    # ---- lifecycle ---------------------------------------------------------------------------
    def warm(self, layers: Iterable[int] | None = None) -> None:
        """Fill the free host slots and then the free device slots of `layers` (default all)
        with experts 0, 1, ..., then reset the counters. Raises ExpertReadError."""
        layers = list(range(self.layout.n_layers) if layers is None else layers)
        jobs = []
        for i in layers:
            host = self.host_tiers[i]
            if host is None:
                continue
            with host.cond:
                for e in range(self.num_experts):
                    if len(host.dir) < host.n_slots and not host.dir.is_mapped(e):
                        slot = host.claim_slot(e, self.counters)
                        assert slot is not None
                        read = (host.read, i, e, slot, self.reader, self.counters, False)
                        jobs.append(self._demand_pool.submit(*read))
        self._wait(jobs)
        jobs = []
        for i in layers:
            tier = self.device_tiers[i]
            with tier.cond:
                for e in range(self.num_experts):
                    if len(tier.dir) < tier.n_slots and not tier.dir.is_mapped(e):
                        claimed = self._claim(i, tier, e, ())
                        assert claimed is not None
                        jobs.append(self._demand_pool.submit(self._fill, i, e, *claimed, False))
        self._wait(jobs)
        for i in layers:  # now, so a fully resident layer's forward never copies its table
            self.layers[i].refresh_table()
        self.counters.reset()

    def close(self) -> None:
        self._demand_pool.shutdown(wait=True)
        self._prefetch_pool.shutdown(wait=True)
        self.reader.close()

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def allocated_bytes(self) -> dict[str, int]:
        """Bytes of the buffers this store allocated: device slots; host slots + staging."""
        host = sum(t.buffers.nbytes for t in self.host_tiers if t is not None)
        return {
            "device": sum(t.buffers.nbytes for t in self.device_tiers),
            "host": host + (self.staging.nbytes if self.staging else 0),
        }

    def check(self) -> None:
        """Invariants (tests): directories consistent, mirrors agree, slots within budget."""
        for tiers in (self.device_tiers, self.host_tiers):
            for tier in tiers:
                if tier is None:
                    continue
                with tier.cond:
                    tier.dir.check()
                    assert len(tier.dir) <= tier.n_slots
                    for e, s in enumerate(tier.slot_mirror):
                        if s >= 0:
                            assert tier.dir.slot_of.get(e) == s and tier.dir.is_ready(e)

    # ---- demand ------------------------------------------------------------------------------
    def load(
        self,
        layer: int,
        experts: Sequence[int],
        keep: Iterable[int] = (),
        pin: bool = False,
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        """Block until `experts` (at most the layer's slot count) are in device slots for the
        work queued next on the compute stream: the missing ones the host tier holds are queued
        on that stream (module doc), the others loaded in parallel; counts hits, misses and the
        stall (time this thread waited). With `pin` every one of `experts` is left pinned (the
        caller unpins), or none when this raises; the ready ones are pinned first, so the loads
        of the others cannot evict them. `meanwhile` runs once the loads have started, before
        waiting for them (a prefetch that should not queue ahead of them)."""
        tier = self.device_tiers[layer]
        with tier.cond:
            useful = tier.dir.use_all_ready(experts, pin)
        if useful is not None:  # all hits: nothing to load or wait for
            if meanwhile is not None:
                meanwhile()
            self.counters.add(device_hits=len(experts), prefetch_useful=useful)
            return
        keep = set(keep) | set(experts)
        start = time.perf_counter()
        jobs: list[Future[None]] = []
        waits: list[int] = []
        claims: list[tuple[int, int]] = []
        loads: list[int] = []
        pinned: list[int] = []
        hits = useful = late = 0
        with tier.cond:
            for e in experts:
                if tier.dir.is_ready(e):
                    hits += 1
                    useful += tier.dir.use(e)
                    if pin:
                        tier.dir.pin(e)
                        pinned.append(e)
                elif tier.dir.is_mapped(e):
                    late += 1
                    waits.append(e)
                else:
                    claimed = self._claim(layer, tier, e, keep, event=False)
                    if claimed is None:
                        waits.append(e)
                        continue
                    claims.append((e, claimed[0]))
        misses = len(experts) - hits
        queued = 0
        try:
            for e, slot in claims:  # from the host tier: queued here; else the pool's
                if self._queue_fill(layer, e, slot, pin):
                    queued += 1
                    if pin:
                        pinned.append(e)
                    continue
                loads.append(e)
                ev = self._queued_work_event()
                jobs.append(self._demand_pool.submit(self._fill, layer, e, slot, ev, False))
            if meanwhile is not None:
                meanwhile()
            self._wait(jobs)
            for e in loads if pin else ():  # ours: ready unless evicted since; pinned before
                self._device_ready(layer, e, keep, pin=True)  # the waits below claim slots
                pinned.append(e)
            for e in waits:
                self._device_ready(layer, e, keep, pin=pin)
                if pin:
                    pinned.append(e)
        except BaseException:
            for j in jobs:  # none left running (they publish or abort their own slots)
                j.exception()
            with tier.cond:
                for e in pinned:
                    tier.dir.unpin(e)
                tier.cond.notify_all()
            raise
        with tier.cond:
            for e in waits:
                useful += tier.dir.use(e)
        counts: dict[str, float] = {"device_hits": hits, "device_misses": misses,
                                    "prefetch_useful": useful, "prefetch_late": late,
                                    "queued_loads": queued}  # fmt: skip
        if misses > queued:  # the compute thread waited for a load
            counts.update(stalls=1, stall_s=time.perf_counter() - start)
        self.counters.add(**counts)

    def _device_ready(self, layer: int, e: int, keep: Iterable[int], pin: bool) -> int:
        """Block until `e` is ready in a device slot (loading it on this thread if nobody is);
        its slot, pinned when `pin`. Raises ExpertReadError if a load we waited for failed."""
        tier = self.device_tiers[layer]
        waited = False
        with tier.cond:
            while True:
                if tier.dir.is_ready(e):
                    if pin:
                        tier.dir.pin(e)
                    return tier.dir.slot_of[e]
                if tier.dir.is_mapped(e):
                    waited = True
                    tier.cond.wait()
                    continue
                if waited and e in tier.failed:
                    reraise(tier.failed[e])
                claimed = self._claim(layer, tier, e, keep)
                if claimed is None:
                    if not tier.dir.loading:
                        raise RuntimeError(
                            f"every device slot of layer {layer} is pinned: release() first"
                        )
                    tier.cond.wait()  # a load in flight will finish and free a candidate
                    continue
                slot, ev = claimed
                break
        self._fill(layer, e, slot, ev, False)
        return self._device_ready(layer, e, keep, pin) if pin else slot

    # ---- prefetch ----------------------------------------------------------------------------
    def prefetch(self, layer: int, experts: Iterable[int]) -> int:
        """Start loading `experts` into layer `layer`'s device slots without waiting; returns
        how many loads were started (experts already mapped, or beyond the free and evictable
        slots, are skipped)."""
        tier = self.device_tiers[layer]
        if tier.n_slots == self.num_experts:
            return 0
        want = list(dict.fromkeys(experts))
        with tier.cond:
            missing = [e for e in want if not tier.dir.is_mapped(e)]
        if not missing:  # the common case of a warm cache: nothing to start
            return 0
        keep = set(want) | self.layers[layer].pending_snapshot()
        jobs = []
        with tier.cond:
            for e in missing:
                if tier.dir.is_mapped(e):
                    continue
                claimed = self._claim(layer, tier, e, keep)
                if claimed is None:
                    break
                jobs.append((e, *claimed))
        host = self.host_tiers[layer]
        cold = [e for e, *_ in jobs if host is None or not host.dir.is_mapped(e)]
        if cold:
            self.reader.will_need(layer, cold)
        one = self.counters.in_phase(self._prefetch_one)  # counted in the phase issuing it
        futures = [self._prefetch_pool.submit(one, layer, e, slot, ev)
                   for e, slot, ev in jobs]  # fmt: skip
        with self._inflight_lock:
            self._inflight = [f for f in self._inflight if not f.done()] + futures
        return len(jobs)

    def drain(self) -> None:
        """Wait until every prefetch started so far has finished (benchmarks, tests)."""
        with self._inflight_lock:
            pending = list(self._inflight)
        for f in pending:
            f.exception()

    def predict(self, layer: int, experts: Iterable[int]) -> None:
        """Predicted routing of `layer`'s next forward: remember it, so the forward can count
        how many of its experts were predicted, and prefetch it while such prefetches are
        being used (`PREFETCH_MIN_USE`)."""
        want = set(experts)
        self._predicted[layer] = want
        tier = self.device_tiers[layer]
        with tier.cond:
            self._predicted_out[layer] = {e for e in want if not tier.dir.is_mapped(e)}
        if self._prefetch_use().pays(PREFETCH_MIN_USE):
            self.counters.add(predicted=len(want))
            if self._predicted_out[layer]:  # (else all of it is in slots: nothing to start)
                self.prefetch(layer, sorted(want))
        else:
            self.counters.add(predicted=len(want), prefetch_held=1)

    def _prefetch_use(self) -> PrefetchUse:
        """The prefetch gate's measure in the current phase."""
        phase = self.counters.phase
        if phase not in self._prefetch_uses:
            self._prefetch_uses[phase] = PrefetchUse(PREFETCH_WINDOW)
        return self._prefetch_uses[phase]

    def account_prediction(self, layer: int, routed: set[int], **counts: int) -> None:
        """Counts how many of `routed` (a forward's experts of `layer`) had been predicted,
        with the forward's other `counts` (one update of the counters), and how many of the
        predicted experts that were not in slots it routed (the prefetch gate's measure)."""
        predicted, out = self._predicted[layer], self._predicted_out[layer]
        if predicted is not None:
            self._predicted[layer] = self._predicted_out[layer] = None
            counts.update(predicted_correct=len(routed & predicted), routed=len(routed))
            if out:
                self._prefetch_use().add(len(out), len(out & routed))
        if counts:
            self.counters.add(**counts)

    def _prefetch_one(self, layer: int, e: int, slot: int, ev: Any) -> None:
        # A failed read is counted and kept in `failed`; a demand for `e` reads again, reports.
        with contextlib.suppress(ExpertReadError):
            self._fill(layer, e, slot, ev, True)

    # ---- routing history ---------------------------------------------------------------------
    def record(self, layer: int, token_experts: Sequence[Sequence[int]]) -> None:
        """Routing of one forward of `layer` (each token's experts): feeds both tiers'
        policies; a promotion of experts not in device slots prefetches them."""
        tier = self.device_tiers[layer]
        with tier.cond:
            tier.dir.new_forward()
            promoted, demoted = tier.dir.record(token_experts), ()
        host = self.host_tiers[layer]
        if host is not None and host.n_slots < self.num_experts:  # (else it never evicts)
            with host.cond:
                host.dir.record(token_experts)
        if promoted:
            self.counters.add(promotions=len(promoted), demotions=len(demoted))
            self.prefetch(layer, promoted)

    # ---- loading one expert ------------------------------------------------------------------
    def _claim(
        self, layer: int, tier: TierLayer, e: int, keep: Iterable[int], event: bool = True
    ) -> tuple[int, Any] | None:
        """Under tier.cond: a device slot for `e` (marked loading), and the CUDA event the copy
        must wait for (`_queued_work_event`; None without `event`: the caller takes one before
        its copy, or copies on the compute stream), or None if no slot is free."""
        claimed = tier.dir.claim(e, keep)
        if claimed is None:
            return None
        slot, evicted = claimed
        tier.failed.pop(e, None)
        if evicted is not None:
            tier.slot_mirror[evicted] = -1
            self.layers[layer].table_dirty = True
            self.counters.add(evictions_device=1)
        return slot, self._queued_work_event() if event else None

    def _queued_work_event(self) -> Any:
        """On CUDA, an event after the compute work queued so far, which a copy into a claimed
        slot waits for (recorded at the claim or later: every read of the slot's old expert was
        queued before the claim). Every claim, not only evictions: a slot freed by a failed load
        may still be read by queued work of the expert evicted before it. Unpinning after
        enqueueing is safe because of this event (LayerExperts.acquire)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.compute_stream)
        return ev

    def _fill(self, layer: int, e: int, slot: int, evict_event: Any, prefetch: bool) -> None:
        """Bring expert `e` into claimed device slot `slot` and publish it."""
        tier = self.device_tiers[layer]
        try:
            with torch.inference_mode():
                n = self._copy_in(layer, e, tier.buffers.raw(slot), evict_event)
        except BaseException as err:
            tier.fail(e, err)
            if isinstance(err, ExpertReadError):
                self.counters.add(read_errors=1)
            raise
        tier.publish(e, slot, fresh=prefetch)
        self.layers[layer].table_dirty = True
        self.counters.add(bytes_to_device=n, prefetch_issued=int(prefetch))

    def _queue_fill(self, layer: int, e: int, slot: int, pin: bool) -> bool:
        """Expert `e` into claimed device slot `slot` from the host tier, its copy queued on the
        compute stream, published (and pinned when `pin`) at once: every later reader of the
        slot is a kernel queued after the copy (module doc). False, with nothing done, when the
        host tier does not hold `e` ready (the caller loads it otherwise)."""
        host = self.host_tiers[layer]
        if host is None or not QUEUE_HOST_LOADS:
            return False
        hslot = host.pin_ready(e)
        if hslot is None:
            return False
        tier = self.device_tiers[layer]
        try:
            with torch.inference_mode():
                dst, src = tier.buffers.raw(slot), host.buffers.raw(hslot)
                if self.cuda:
                    stream = torch.cuda.current_stream(self.device)
                    for d, s in zip(dst, src, strict=True):
                        d.copy_(s, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(stream)
                    host.copied_from(hslot, done)
                else:
                    for d, s in zip(dst, src, strict=True):
                        d.copy_(s)
        except BaseException as err:
            tier.fail(e, err)
            raise
        finally:
            host.unpin(e)
        tier.publish(e, slot, pin)
        self.layers[layer].table_dirty = True
        self.counters.add(host_hits=1, bytes_to_device=sum(d.numel() for d in dst))
        return True

    def _copy_in(self, layer: int, e: int, dst: Sequence[torch.Tensor], evict_event: Any) -> int:
        """Expert `e`'s bytes into device buffers `dst`, from the host tier or the file."""
        host = self.host_tiers[layer]
        if host is not None:
            hslot = host.pinned(layer, e, self.reader, self.counters)
            try:
                return self._copy(dst, host.buffers.raw(hslot), evict_event)
            finally:
                host.unpin(e)
        self.counters.add(host_misses=1)
        if not self.cuda:  # the device tier is CPU memory: read straight into the slot
            n = self.reader.read_expert(layer, e, dst)
            self.counters.add(disk_reads=1, bytes_from_disk=n)
            return n
        assert self.staging is not None
        bufs = self.staging.get()
        try:
            staged = StagingPool.cut(bufs, self.layout.layers[layer])
            n = self.reader.read_expert(layer, e, staged)
            self.counters.add(disk_reads=1, bytes_from_disk=n)
            return self._copy(dst, staged, evict_event)
        finally:
            self.staging.put(bufs)

    def _copy(
        self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], evict_event: Any
    ) -> int:
        """dst <- src per kind; on CUDA on the copy stream, finished before returning."""
        if not self.cuda:
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)
        else:
            with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
                if evict_event is not None:
                    self.copy_stream.wait_event(evict_event)
                for d, s in zip(dst, src, strict=True):
                    d.copy_(s, non_blocking=True)
                done = torch.cuda.Event(blocking=COPY_WAIT_BLOCKING)
                done.record(self.copy_stream)
            done.synchronize()  # this I/O thread waits, never the compute thread
        return sum(d.numel() for d in dst)

    @staticmethod
    def _wait(jobs: Sequence[Future[None]]) -> None:
        """Wait for every job, then raise the first error (so no load is left running)."""
        errors = [j.exception() for j in jobs]
        for err in errors:
            if err is not None:
                raise err

    def views(self, layer: int, slot: int) -> ExpertViews:
        return self.device_tiers[layer].buffers.views(slot)
