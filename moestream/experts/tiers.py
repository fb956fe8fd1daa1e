"""Slot buffers of the device and host tiers, and the per-layer state that guards them.

A tier of one layer owns one fixed buffer per tensor kind, [n_slots, expert_bytes] uint8,
allocated once (never grown, so a budget is never exceeded); slot s of every kind holds the same
expert. Views of a slot are QTensors in the GGUF block format, made once at build.

Letters: S slots, E experts, F expert FFN size, H hidden size.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

import torch

from moestream.experts.counters import ExpertCounters
from moestream.experts.disk import ExpertFileReader, ExpertReadError
from moestream.experts.placement import ExpertTensor
from moestream.experts.policy import SlotDirectory
from moestream.weights.qtensor import FLOAT_TYPES, QTensor, row_bytes

ExpertViews = tuple[QTensor, QTensor, QTensor]  # gate [F, H], up [F, H], down [H, F]


def _qtensor(raw: torch.Tensor, tensor: ExpertTensor, lead: tuple[int, ...] = ()) -> QTensor:
    """A QTensor of logical shape (*lead, *tensor.shape) over uint8 bytes `raw`."""
    shape = (*lead, *tensor.shape)
    if tensor.qtype in FLOAT_TYPES:
        return QTensor(raw.view(FLOAT_TYPES[tensor.qtype]).view(shape), tensor.qtype, shape)
    rb = row_bytes(tensor.qtype, tensor.shape[-1])
    return QTensor(raw.view(*shape[:-1], rb), tensor.qtype, shape)


class SlotBuffers:
    """`n_slots` experts' worth of bytes of one layer on one device, allocated once."""

    def __init__(
        self,
        tensors: Sequence[ExpertTensor],
        n_slots: int,
        device: torch.device,
        pin_memory: bool = False,
    ):
        self.tensors = tuple(tensors)
        self.n_slots = n_slots
        pin = pin_memory and device.type == "cpu" and torch.cuda.is_available()
        self.buffers = tuple(
            torch.empty((n_slots, t.expert_bytes), dtype=torch.uint8, device=device, pin_memory=pin)
            for t in self.tensors
        )  # per kind: [S, expert_bytes]
        self._views = [
            tuple(_qtensor(b[s], t) for b, t in zip(self.buffers, self.tensors))
            for s in range(n_slots)
        ]
        self._stacked = tuple(
            _qtensor(b, t, (n_slots,)) for b, t in zip(self.buffers, self.tensors)
        )  # gate, up [S, F, H], down [S, H, F]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def raw(self, slot: int) -> tuple[torch.Tensor, ...]:
        """Slot `slot`'s bytes per kind, 1-D uint8 (the targets of reads and copies)."""
        return tuple(b[slot] for b in self.buffers)

    def views(self, slot: int) -> ExpertViews:
        return self._views[slot]  # type: ignore[return-value]

    def stacked(self) -> ExpertViews:
        """gate, up [S, F, H] and down [S, H, F] over all slots (the fused kernel's operands;
        views made once, at build)."""
        return self._stacked  # type: ignore[return-value]


class TierLayer:
    """One layer of one tier: buffers, the directory of who sits where, and the condition that
    guards both (waiters are woken when a load finishes or fails, or a pin is released).

    `slot_mirror` [E] is expert -> slot (-1: not ready), kept with the directory under `cond`.
    `failed` holds the error of a load that failed while someone may wait for it.
    """

    def __init__(self, buffers: SlotBuffers, directory: SlotDirectory, num_experts: int):
        self.buffers = buffers
        self.dir = directory
        self.cond = threading.Condition(threading.Lock())
        self.slot_mirror = [-1] * num_experts
        self.failed: dict[int, BaseException] = {}

    @property
    def n_slots(self) -> int:
        return self.buffers.n_slots

    def publish(self, e: int, slot: int, pin: bool = False, fresh: bool = False) -> None:
        """The load of `e` into its claimed `slot` is done (a copy queued on a stream counts:
        its readers are queued after it): ready, pinned when `pin`, waiters woken."""
        with self.cond:
            self.dir.finish(e, fresh=fresh)
            if pin:
                self.dir.pin(e)
            self.slot_mirror[e] = slot
            self.cond.notify_all()

    def fail(self, e: int, err: BaseException) -> None:
        """The load of `e` failed: its slot is free again; whoever waited for it gets `err`."""
        with self.cond:
            self.dir.abort(e)
            self.failed[e] = err
            self.cond.notify_all()


def reraise(err: BaseException) -> None:
    """Report, in this thread, a load that failed in another one."""
    if isinstance(err, ExpertReadError):
        raise ExpertReadError(str(err)) from None
    raise RuntimeError("loading an expert failed in an I/O thread") from err


class HostTier(TierLayer):
    """One layer of the host tier: an inclusive cache of the file in (pinned) host RAM. A slot
    being copied from is pinned (`pinned` ... `unpin`), so no read overwrites it meanwhile; a
    slot that a copy queued on a stream reads (`copied_from`) is overwritten only after that
    copy has run (`read` waits for its event)."""

    def __init__(self, buffers: SlotBuffers, directory: SlotDirectory, num_experts: int):
        super().__init__(buffers, directory, num_experts)
        self._copies: dict[int, Any] = {}  # slot -> event of the last queued copy from it

    def pin_ready(self, e: int) -> int | None:
        """The slot holding expert `e`, pinned, if it is ready now (counted by the caller);
        else None."""
        with self.cond:
            if not self.dir.is_ready(e):
                return None
            self.dir.pin(e)
            return self.dir.slot_of[e]

    def copied_from(self, slot: int, done: Any) -> None:
        """A copy from `slot` was queued on a stream; `done` is an event recorded after it."""
        with self.cond:
            self._copies[slot] = done

    def pinned(self, layer: int, e: int, reader: ExpertFileReader, counters: ExpertCounters) -> int:
        """The slot holding expert `e`, read from the file first if absent; pinned."""
        waited = False
        with self.cond:
            while True:
                if self.dir.is_ready(e):
                    self.dir.pin(e)
                    counters.add(host_hits=1)
                    return self.dir.slot_of[e]
                if self.dir.is_mapped(e):
                    waited = True
                    self.cond.wait()
                    continue
                if waited and e in self.failed:
                    reraise(self.failed[e])
                slot = self.claim_slot(e, counters)
                if slot is None:
                    self.cond.wait()  # every slot pinned or loading: one will be released
                    continue
                break
        return self.read(layer, e, slot, reader, counters)

    def unpin(self, e: int) -> None:
        with self.cond:
            self.dir.unpin(e)
            self.cond.notify_all()

    def claim_slot(self, e: int, counters: ExpertCounters) -> int | None:
        """Under `cond`: a slot for `e`, marked loading (None: none can be had now)."""
        claimed = self.dir.claim(e)
        if claimed is None:
            return None
        slot, evicted = claimed
        self.failed.pop(e, None)
        if evicted is not None:
            self.slot_mirror[evicted] = -1
            counters.add(evictions_host=1)
        return slot

    def read(
        self,
        layer: int,
        e: int,
        slot: int,
        reader: ExpertFileReader,
        counters: ExpertCounters,
        pin: bool = True,
    ) -> int:
        """Read expert `e` into claimed slot `slot` and publish it (pinned when `pin`)."""
        try:
            with self.cond:
                copy = self._copies.pop(slot, None)
            if copy is not None:  # a queued copy from the slot's last expert has run
                copy.synchronize()
            with torch.inference_mode():
                n = reader.read_expert(layer, e, self.buffers.raw(slot))
        except BaseException as err:
            self.fail(e, err)
            raise
        self.publish(e, slot, pin)
        counters.add(host_misses=1, disk_reads=1, bytes_from_disk=n, bytes_to_host=n)
        return slot


class StagingPool:
    """Buffers for disk reads bound for device slots when there is no host slot to read into
    (CUDA with no host tier): pinned when the host budget paid for them, pageable otherwise."""

    def __init__(self, tensors_per_layer: Sequence[Sequence[ExpertTensor]], n: int, pinned: bool):
        sizes = [max(ts[k].expert_bytes for ts in tensors_per_layer) for k in range(3)]
        pin = pinned and torch.cuda.is_available()
        self._free: queue.SimpleQueue[tuple[torch.Tensor, ...]] = queue.SimpleQueue()
        self.nbytes = n * sum(sizes)
        for _ in range(n):
            self._free.put(tuple(torch.empty(s, dtype=torch.uint8, pin_memory=pin) for s in sizes))

    def get(self) -> tuple[torch.Tensor, ...]:
        """A free staging buffer per kind (blocks until one is free); give it back with `put`."""
        return self._free.get()

    def put(self, bufs: tuple[torch.Tensor, ...]) -> None:
        self._free.put(bufs)

    @staticmethod
    def cut(
        bufs: Sequence[torch.Tensor], tensors: Sequence[ExpertTensor]
    ) -> tuple[torch.Tensor, ...]:
        """The leading bytes of each kind's buffer that one expert of `tensors` fills."""
        return tuple(b[: t.expert_bytes] for b, t in zip(bufs, tensors))
