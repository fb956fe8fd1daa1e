"""Zero-copy expert placement: some experts of each layer in device memory, the rest in pinned
host memory that the GPU reads directly, both found through one device-side address table.

The streamed path (`prefetch.StreamedMoE`) reads each layer's routing on the host, copies the
missing experts into device slots and then runs the layer: one host synchronisation per layer,
and a decode step captured only as a chain of CUDA graphs cut at those reads
(`runner/piecewise.py`). Here nothing moves at run time: the fused
MoE kernel's "mmvq" path reads expert e's bytes at `expert_addr[:, e]` (`kernels.moe.fused_moe`),
a device address for the experts placed on the device and a host address for the others
(pinned host memory is mapped into the GPU's address space under unified addressing, so a
kernel load from it crosses the host link). A step makes no host synchronisation and replays
as a CUDA graph; the price of a host-placed expert is its bytes over the host link on every use.

Placement starts with the first `n_device` experts of every layer by id and then follows the
routing: `rebalance()` (the engine calls it every `expert_rebalance_steps` steps, all layers with
one device sync) reads the per-expert read counts of the steps since the last call, keeps a
decaying count per expert (`heat`), and swaps the hottest host-placed experts with the coldest
device-placed ones while the host one is clearly hotter (`HYSTERESIS`, `NOISE_SIGMAS`). A swap
copies both experts through a device temporary and rewrites their two address-table entries, all on
the current stream, so steps queued before it read the old placement and steps after it the new
(both are the same bytes: results never depend on placement); a CUDA graph reads the table at every
replay. Real models route unevenly, which this exploits; random weights route almost uniformly,
where no placement does better than any other and the noise margin keeps swaps rare. Off CUDA
(tests), both tiers are ordinary memory and the layer takes the per-expert reference path through
`weights(e)`.

With `n_cpu`, the first `n_cpu` host slots of each layer are computed by the host's cores
instead of read across the link (`experts.host_compute`: posts from the stream answered by a
host thread, or CUDA host functions; the GPU's bits); an expert promoted out of such a slot
leaves it to the one demoted into it.

With a prefill stage (`ExpertStage`, `prefill_stage=True` in `attach_zero_copy`), a forward of
at least `STAGE_MIN_TOKENS` tokens first copies the layer's whole host tier into device memory
shared by the layers (one layer's host tier; DMA at the link's full rate) and reads the host
experts there (`stage_addr`) instead of across the link once per chunk of 32 tokens: the same
kernels and launch shape, so the same bits. The stage's bytes come out of the device budget.

Counters: reads of every expert, kept on the device (no sync), summed per tier by
`read_counts()` (reads between two rebalances count for the tier the expert was in: "device",
"host" across the link, "cpu" computed by the host, "stage" a host expert read from the prefill
stage); swaps and the bytes they copied; the stage's fills and bytes.

Letters: E experts, F expert FFN, H hidden, S_d / S_h experts per tier.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType

from moestream.errors import CapacityError, UnsupportedError
from moestream.experts.host_compute import HostCompute, LayerHostWork
from moestream.weights.qtensor import QTensor

# A host-placed expert replaces a device-placed one only when its heat exceeds the other's by
# this factor and one read, and by NOISE_SIGMAS standard deviations of the difference of two
# counts (Poisson: the square root of their sum). Under uniform routing the hottest of 64
# counts beats the coldest by the factor alone at every rebalance (11 swaps a window in a
# simulation of the 30B's layer at half on the device); with the noise margin, 0.07, while
# skewed routing keeps 99% of the device share it reached without it.
HYSTERESIS = 1.25
NOISE_SIGMAS = 3.0
# The weight of a rebalance's earlier heat against the reads since (a window of
# `expert_rebalance_steps` steps): routing reuse is cyclic over a few hundred tokens, so a
# few windows of memory.
HEAT_DECAY = 0.5
# Tokens from which a forward copies the host tier to the prefill stage. The kernels read the
# host experts once per chunk of 32 tokens (256 assignments), so from two chunks up a copy of
# the tier at the link's DMA rate moves fewer bytes than the chunks' reads, and the chunks then
# read device memory.
STAGE_MIN_TOKENS = 64


class ExpertStage:
    """Device memory for one layer's host tier, shared by the layers of a model (they run one
    after another): per weight kind a byte buffer as large as the largest layer's host stack
    of that kind (a quant mix gives layers different row sizes), which `ZeroCopyExperts` fills
    by one copy per kind before a long forward (`experts.paged` gathers a forward's routed
    experts into a whole layer's stack of it instead). Copies and reads are all on the current
    stream, so a layer's copy waits for the previous layer's reads."""

    def __init__(self, nbytes: Sequence[int], device: torch.device):
        self.buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in nbytes]
        # layer fills and bytes copied, counted on the device: a prefill graph's replays count
        self._counts = torch.zeros(2, dtype=torch.int64, device=device)

    def view(self, kind: int, host: torch.Tensor) -> torch.Tensor:
        """The stage's memory for a layer's host stack `host` (uint8 [S_h, rows, row bytes])."""
        return self.buffers[kind][: host.numel()].view(host.shape)

    def fill(self, host_stacks: Sequence[torch.Tensor]) -> None:
        """Copy a layer's host tier (pinned) into the stage, queued on the current stream."""
        for kind, host in enumerate(host_stacks):
            self.view(kind, host).copy_(host, non_blocking=True)
        # scalar adds (a graph captures them; a tensor made from host values would be a copy)
        self._counts[0].add_(1)
        self._counts[1].add_(sum(h.numel() for h in host_stacks))

    def counts(self) -> tuple[int, int]:
        """(layer fills, bytes copied into the stage) so far (one device sync)."""
        copies, nbytes = self._counts.tolist()
        return copies, nbytes


def host_computable(stacks: Sequence[QTensor]) -> bool:
    """Whether the host's native code can compute these experts (`native.moe_host_rows`:
    Q4_K gate/up, a Q4_K or Q6_K down, F and H multiples of 256)."""
    gate, up, down = stacks
    q = GGMLQuantizationType
    shapes = gate.shape[1] % 256 == 0 and gate.shape[2] % 256 == 0
    return shapes and gate.qtype == up.qtype == q.Q4_K and down.qtype in (q.Q4_K, q.Q6_K)


class TwoTierStacks:
    """Sizes of a provider that keeps its experts' stacks in device memory (`_dev`) and pinned
    host memory (`_host`), `_expert_bytes` the bytes of one expert (zero-copy and paged
    placement)."""

    _dev: list[QTensor]
    _host: list[QTensor]
    _expert_bytes: int

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (gate, up and down)."""
        return self._expert_bytes

    @property
    def nbytes(self) -> dict[str, int]:
        """Bytes held per tier ("device", "host")."""
        return {
            "device": sum(w.data.numel() for w in self._dev),
            "host": sum(w.data.numel() for w in self._host),
        }


class ZeroCopyExperts(TwoTierStacks):
    """The `ExpertProvider` of one layer under zero-copy placement (module docstring)."""

    def __init__(
        self,
        stacks: Sequence[QTensor],
        n_device: int,
        device: torch.device | str,
        n_cpu: int = 0,
        compute: HostCompute | None = None,
    ):
        gate, up, down = stacks  # [E, F, H], [E, F, H], [E, H, F] (host, file layout)
        e = gate.shape[0]
        if not 0 <= n_device <= e:
            raise ValueError(f"n_device {n_device} not in [0, {e}]")
        if not 0 <= n_cpu <= e - n_device:
            raise ValueError(f"n_cpu {n_cpu} not in [0, {e - n_device}] (the host slots)")
        if n_cpu and (compute is None or not host_computable(stacks)):
            raise UnsupportedError(
                "host-computed experts need Q4_K gate/up, a Q4_K or Q6_K down and a HostCompute"
            )
        self.device = torch.device(device)
        self.n_device = n_device
        self._expert_bytes = sum(w.data[0].numel() * w.data.element_size() for w in stacks)
        cuda = self.device.type == "cuda"
        self._dev: list[QTensor] = []
        self._host: list[QTensor] = []
        for w in (gate, up, down):
            dev = w.data[:n_device].to(self.device)  # [S_d, rows, row_bytes]
            host = torch.empty(
                (e - n_device, *w.data.shape[1:]), dtype=w.data.dtype, pin_memory=cuda
            )  # [S_h, rows, row_bytes]
            host.copy_(w.data[n_device:])
            self._dev.append(QTensor(dev, w.qtype, (n_device, *w.shape[1:])))
            self._host.append(QTensor(host, w.qtype, (e - n_device, *w.shape[1:])))
        # Where each expert is: device slot i (`_on_device[e]`) or host slot i, i = `_slot[e]`.
        self._on_device = [i < n_device for i in range(e)]
        self._slot = [i if i < n_device else i - n_device for i in range(e)]
        addr = [
            [self._slot_data(k, i).data_ptr() for i in range(e)] for k in range(3)
        ]  # [3, E] byte addresses
        if any(a % 16 for row in addr for a in row):  # the kernel's contract
            raise UnsupportedError("expert byte sizes are not multiples of 16: no zero-copy")
        self.expert_addr = torch.tensor(addr, dtype=torch.int64, device=self.device)
        self._reads = torch.zeros(e, dtype=torch.int64, device=self.device)  # [E] per expert
        self._staged = torch.zeros(e, dtype=torch.int64, device=self.device)  # [E] in staged
        self._seen = [0] * e  # `_reads` at the last rebalance
        self._staged_seen = [0] * e  # `_staged` at the last rebalance
        # reads to the last rebalance per tier ("stage": host experts read from the stage)
        self._tier_reads = {"device": 0, "host": 0, "cpu": 0, "stage": 0}
        self.heat = [0.0] * e
        self.swaps = 0
        # Types, shapes and row strides for the kernel (a slot of each stack, S = 1), on the
        # device like the activations: a device slot, or with none one slot's worth of memory.
        self.templates = tuple(
            QTensor(
                dev.data[:1] if n_device else dev.data.new_empty((1, *dev.data.shape[1:])),
                w.qtype,
                (1, *w.shape[1:]),
            )
            for dev, w in zip(self._dev, (gate, up, down), strict=True)
        )
        self._views = [self._view(i) for i in range(e)]
        # Host-computed experts: the first n_cpu host slots (`experts.host_compute`).
        self.n_cpu = n_cpu
        self.host_marked = np.zeros(e, dtype=np.int8)  # [E] 1: computed by the host
        # (`host_tables`, read by the host functions)
        self.host_marks = torch.zeros(e, dtype=torch.int32, device=self.device)  # [E]: the
        # kernels' marks (negative: the host's)
        self._mark_all()
        self._host_addr = np.zeros((3, e), dtype=np.uint64)  # [3, E] host-placed experts' bytes
        for i in range(e):
            self._set_host_addr(i)
        self.stage: ExpertStage | None = None
        self.stage_addr: torch.Tensor | None = None  # [3, E]: expert_addr, the stage for host
        self.host_work: LayerHostWork | None = None
        if n_cpu:
            from moestream.kernels.moe_mmvq import HYBRID_CONFIG, down_groups, up_groups

            self.host_work = LayerHostWork(
                compute,  # type: ignore[arg-type]
                self,
                up_groups(HYBRID_CONFIG, gate.shape[2]),
                down_groups(HYBRID_CONFIG, gate.shape[1]),
            )

    def attach_stage(self, stage: ExpertStage) -> None:
        """Read host experts from `stage` in forwards of `STAGE_MIN_TOKENS` tokens or more
        (module docstring); `stage_addr` follows promotions like `expert_addr`."""
        self.stage = stage
        self.stage_addr = torch.tensor(
            [[self._stage_address(k, e) for e in range(self.num_experts)] for k in range(3)],
            dtype=torch.int64, device=self.device,
        )  # fmt: skip

    def _stage_address(self, kind: int, e: int) -> int:
        if self._on_device[e] or self.stage is None:
            return self._slot_data(kind, e).data_ptr()
        return self.stage.view(kind, self._host[kind].data)[self._slot[e]].data_ptr()

    def addresses(self, tokens: int) -> tuple[torch.Tensor, bool]:
        """(the address table for a forward of `tokens` tokens, whether it is the stage's):
        from `STAGE_MIN_TOKENS` up, with a stage, the layer's host tier is copied into it now
        (queued on the current stream) and read there; else `expert_addr`."""
        if self.stage is None or self.stage_addr is None or tokens < STAGE_MIN_TOKENS:
            return self.expert_addr, False
        self.stage.fill([w.data for w in self._host])
        return self.stage_addr, True

    def set_cpu_slots(self, n_cpu: int) -> None:
        """Mark the first `n_cpu` host slots for the host's cores instead of the construction's
        count (a layer built with host work, `n_cpu` > 0). The caller has synchronised the
        device: queued host work reads the marks when it runs (as for `rebalance`). CUDA
        graphs need no recapture: they read the marks and the address table at every replay."""
        if self.host_work is None:
            raise ValueError("this layer was placed without host-computed experts")
        if not 0 <= n_cpu <= self.num_experts - self.n_device:
            raise ValueError(f"n_cpu {n_cpu} not in [0, {self.num_experts - self.n_device}]")
        self.n_cpu = n_cpu
        self._mark_all()

    def _mark_all(self) -> None:
        """Both mark tables from the placement and `n_cpu`."""
        self.host_marked[:] = [self._computed_by_host(e) for e in range(len(self.host_marked))]
        self.host_marks.copy_(torch.from_numpy(-self.host_marked.astype(np.int32)))

    def _computed_by_host(self, e: int) -> bool:
        return not self._on_device[e] and self._slot[e] < self.n_cpu

    def _set_host_addr(self, e: int) -> None:
        for k in range(3):
            self._host_addr[k, e] = 0 if self._on_device[e] else self._slot_data(k, e).data_ptr()

    def host_tables(self) -> tuple[np.ndarray, np.ndarray, int, int, bool]:
        """(marks int8 [E], host addresses uint64 [3, E] of gate, up, down, gate/up row bytes,
        down row bytes, down is Q6_K) as `experts.c`'s host_layer reads them: arrays that
        promotion updates in place."""
        gu_row_bytes, down_row_bytes = self._host[0].data.shape[-1], self._host[2].data.shape[-1]
        q6 = self._host[2].qtype == GGMLQuantizationType.Q6_K
        return self.host_marked, self._host_addr, gu_row_bytes, down_row_bytes, q6

    def _slot_data(self, kind: int, e: int) -> torch.Tensor:
        tier = self._dev if self._on_device[e] else self._host
        return tier[kind].data[self._slot[e]]

    def _view(self, e: int) -> tuple[QTensor, ...]:
        return tuple(
            QTensor(self._slot_data(k, e), t.qtype, t.shape[1:]) for k, t in enumerate(self._dev)
        )

    # ---- promotion -------------------------------------------------------------------------
    def rebalance(
        self, reads: Sequence[int] | None = None, staged: Sequence[int] | None = None
    ) -> int:
        """Fold the reads since the last call into the per-tier counts and each expert's heat,
        then swap hot host-placed experts with cold device-placed ones (module docstring).
        Returns the number of swaps. `reads`, `staged`: the read counters' values (forwards
        without and with the stage), if the caller has read them (`rebalance_all` reads every
        layer's in one sync); else one device sync."""
        # The read-back is a device sync (here or in `rebalance_all`): every queued step, its host
        # functions included, has run, so `_swap` may rewrite the host tables that later host
        # functions read (they are not stream-ordered; the expert bytes and the address table
        # are).
        if reads is None or staged is None:
            reads, staged = torch.stack([self._reads, self._staged]).tolist()
        reads, staged = list(reads), list(staged)
        for e, n in enumerate(self._fold(self._tier_reads, reads, staged)):
            self.heat[e] = HEAT_DECAY * self.heat[e] + n
        self._seen, self._staged_seen = reads, staged
        host = sorted((e for e in range(len(reads)) if not self._on_device[e]), key=self._hotter)
        device = sorted((e for e in range(len(reads)) if self._on_device[e]), key=self._colder)
        swaps = 0
        for hot, cold in zip(host, device):
            a, b = self.heat[hot], self.heat[cold]
            if a < HYSTERESIS * b + 1 or a - b <= NOISE_SIGMAS * math.sqrt(a + b):
                break
            self._swap(cold, hot)
            swaps += 1
        self.swaps += swaps
        return swaps

    def _hotter(self, e: int) -> tuple[float, int]:
        return (-self.heat[e], e)

    def _colder(self, e: int) -> tuple[float, int]:
        return (self.heat[e], e)

    def _swap(self, out: int, into: int) -> None:
        """Device-placed `out` and host-placed `into` trade places: bytes and table entries."""
        d, h = self._slot[out], self._slot[into]
        for k in range(3):
            dev, host = self._dev[k].data[d], self._host[k].data[h]
            leaving = dev.clone()
            dev.copy_(host, non_blocking=True)
            host.copy_(leaving, non_blocking=True)
        self._on_device[out], self._on_device[into] = False, True
        self._slot[out], self._slot[into] = h, d
        for e in (out, into):
            for k in range(3):
                self.expert_addr[k, e] = self._slot_data(k, e).data_ptr()
                if self.stage_addr is not None:
                    self.stage_addr[k, e] = self._stage_address(k, e)
            self._views[e] = self._view(e)
            self.host_marked[e] = self._computed_by_host(e)
            self.host_marks[e] = -1 if self.host_marked[e] else 0
            self._set_host_addr(e)

    # ---- ExpertProvider ----------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.expert_addr.shape[1]

    # every expert has a fixed place and host work is queued in the stream: no
    # host sync per forward (CUDA graphs capture it)
    fully_resident = True

    def weights(self, e: int) -> tuple[QTensor, QTensor, QTensor]:
        return self._views[e]  # type: ignore[return-value]

    def stacked(self) -> tuple[QTensor, ...]:
        """Types and shapes of the weights (one slot each; the data is found by address)."""
        return self.templates

    # ---- counters ----------------------------------------------------------------------------
    def observe(self, ids: torch.Tensor, staged: bool = False) -> None:
        """Add the routed experts' reads (ids [T, k]) to the per-expert device-side counts (two
        small launches, no sync); `staged`: a forward that read the host tier from the stage."""
        flat = ids.reshape(-1)
        counts = self._staged if staged else self._reads
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))

    def _fold(
        self, counts: dict[str, int], reads: Sequence[int], staged: Sequence[int]
    ) -> list[int]:
        """Add each expert's reads since the last rebalance (counter values `reads`, `staged`)
        to `counts` by tier; returns each expert's new reads."""
        new = []
        for e, (now, seen) in enumerate(zip(reads, self._seen)):
            d, s = now - seen, staged[e] - self._staged_seen[e]
            counts[self._tier(e)] += d
            counts["device" if self._on_device[e] else "stage"] += s
            new.append(d + s)
        return new

    def read_counts(self) -> dict[str, int]:
        """Expert reads so far: {"device": n, "host": n (across the link), "cpu": n (computed
        by the host), "stage": n (host experts read from the prefill stage)} (one device
        sync)."""
        counts = dict(self._tier_reads)
        self._fold(counts, *torch.stack([self._reads, self._staged]).tolist())
        return counts

    def _tier(self, e: int) -> str:
        if self._on_device[e]:
            return "device"
        return "cpu" if self.host_marked[e] else "host"


def rebalance_all(providers: Sequence[ZeroCopyExperts]) -> int:
    """`rebalance` every layer, their read counters fetched in one device sync; the swaps."""
    if not providers:
        return 0
    rows = torch.stack([p._reads for p in providers] + [p._staged for p in providers]).tolist()
    n = len(providers)
    return sum(p.rebalance(rows[i], rows[n + i]) for i, p in enumerate(providers))


def zero_copy_snapshot(providers: Sequence[ZeroCopyExperts]) -> dict[str, float | int]:
    """Reads per tier over all layers so far, the share served from the device, the bytes
    that crossed the host link for reads, and the swaps of `rebalance` with the bytes they
    copied (both experts of a swap cross the link; one device sync per layer). The host link's
    bytes count the reads across it and the copies into the prefill stage."""
    device = host = cpu = staged = host_bytes = cpu_bytes = swaps = swap_bytes = 0
    for p in providers:
        c = p.read_counts()
        device += c["device"]
        host += c["host"]
        cpu += c["cpu"]
        staged += c["stage"]
        host_bytes += c["host"] * p.expert_bytes
        cpu_bytes += c["cpu"] * p.expert_bytes
        swaps += p.swaps
        swap_bytes += 2 * p.swaps * p.expert_bytes
    total = device + host + cpu + staged
    compute = next((p.host_work.compute for p in providers if p.host_work), None)
    stage = next((p.stage for p in providers if p.stage), None)
    stage_copies, stage_bytes = stage.counts() if stage else (0, 0)
    counted = compute.counters if compute else {}
    return {
        "cpu_compute_seconds": counted.get("compute_s", 0.0),
        # the poller's failures its steps have not yet raised (`HostCompute.check`)
        "cpu_poll_bad_posts": counted.get("poll_bad_posts", 0),
        "cpu_poll_timeouts": counted.get("poll_timeouts", 0),
        "device_reads": device,
        "host_reads": host,
        "cpu_reads": cpu,
        "stage_reads": staged,
        "device_read_share": device / total if total else 0.0,
        "host_link_bytes": host_bytes + stage_bytes,
        "cpu_bytes": cpu_bytes,
        "stage_bytes": stage_bytes,
        "stage_copies": stage_copies,
        "swaps": swaps,
        "swap_bytes": swap_bytes,
    }


def zero_copy_metric_families(
    snapshot: dict[str, float | int],
) -> Iterator[tuple[str, str, str, float]]:
    """(name, help, type, value) for Prometheus from a `zero_copy_snapshot`, as
    `experts.metric_families` gives them for a store."""
    docs = {
        "device_reads": "Expert reads served from device memory (zero-copy placement)",
        "host_reads": "Expert reads served from pinned host memory over the host link",
        "cpu_reads": "Expert reads computed by the host's cores from pinned host memory",
        "host_link_bytes": "Expert bytes read over the host link",
        "cpu_bytes": "Expert bytes read by the host's cores",
        "swaps": "Host-placed experts promoted to the device (a colder one demoted each)",
        "swap_bytes": "Expert bytes copied between the tiers by promotions",
        "cpu_compute_seconds": "Time the host spent computing experts",
        "cpu_poll_bad_posts": "Posts to the host's expert poller that named no job (not yet "
        "raised by a step)",
        "cpu_poll_timeouts": "Waits for the host's expert rows that gave up (not yet raised by "
        "a step)",
        "stage_reads": "Expert reads of host-placed experts from the prefill stage",
        "stage_bytes": "Expert bytes copied into the prefill stage (over the host link)",
        "stage_copies": "Layer host tiers copied into the prefill stage",
    }
    for name, doc in docs.items():
        yield f"moestream_expert_zero_copy_{name}", doc, "counter", float(snapshot[name])
    yield (
        "moestream_expert_zero_copy_device_read_share",
        "Share of expert reads served from device memory",
        "gauge",
        float(snapshot["device_read_share"]),
    )


def attach_zero_copy(
    model: object,
    gpu_expert_cache_gib: float,
    host_expert_cache_gib: float | None = None,
    cpu_fraction: float = 0.0,
    cpu_threads: int | None = None,
    prefill_stage: bool = False,
) -> list[ZeroCopyExperts]:
    """Replace every MoE layer's experts of `model` (built with `defer_expert_tensors`, so its
    stacks are host views of the file) by `ZeroCopyExperts` with as many experts per layer on
    the device as `gpu_expert_cache_gib` holds. The rest go to pinned host memory, which must
    fit `host_expert_cache_gib` when given (CapacityError otherwise). `cpu_fraction` of those
    (rounded to whole experts per layer) are computed by the host's cores (`cpu_threads`,
    default all), the others read across the host link. `prefill_stage`: the budget also holds
    an `ExpertStage` (one layer's host tier) for long forwards (CapacityError if it cannot)."""
    if not 0.0 <= cpu_fraction <= 1.0:
        raise ValueError(f"cpu_fraction must be in [0, 1], got {cpu_fraction}")
    moes = list(model.moe_layers())  # type: ignore[attr-defined]
    if not moes:
        raise UnsupportedError("zero-copy expert placement applies to MoE models only")
    stacks = [m.experts.stacked() for m in moes]
    per_expert = sum(w.data[0].numel() for w in stacks[0])
    e = stacks[0][0].shape[0]
    budget = int(gpu_expert_cache_gib * 2**30)
    n_device = min(e, budget // (per_expert * len(moes)))
    if prefill_stage:  # the stage holds e - n experts of each kind's largest layer
        staged = sum(max(st[k].data[0].numel() for st in stacks) for k in range(3))

        def need(n: int) -> int:
            return n * len(moes) * per_expert + (e - n) * staged

        while n_device and need(n_device) > budget:
            n_device -= 1
        if n_device < e and need(n_device) > budget:
            raise CapacityError(
                f"the prefill stage needs {e * per_expert / 2**30:.2f} GiB of "
                f"--gpu-expert-cache-gib (one layer's experts), more than {gpu_expert_cache_gib:g}"
            )
    host_bytes = (e - n_device) * per_expert * len(moes)
    if host_expert_cache_gib is not None and host_bytes > host_expert_cache_gib * 2**30:
        raise CapacityError(
            f"zero-copy placement keeps {e - n_device} experts per layer in pinned host memory "
            f"({host_bytes / 2**30:.2f} GiB), more than --host-expert-cache-gib "
            f"{host_expert_cache_gib:g}"
        )
    device = model.device  # type: ignore[attr-defined]
    n_cpu = round(cpu_fraction * (e - n_device))
    compute = None
    if n_cpu:
        if not all(host_computable(st) for st in stacks):
            raise UnsupportedError(
                "experts computed by the host need Q4_K gate/up and a Q4_K or Q6_K down"
            )
        compute = HostCompute(torch.device(device), cpu_threads)
    providers = []
    for moe, st in zip(moes, stacks, strict=True):
        provider = ZeroCopyExperts(st, n_device, device, n_cpu, compute)
        moe.experts = provider
        providers.append(provider)
    if prefill_stage and n_device < e:
        largest = [max(p._host[k].data.numel() for p in providers) for k in range(3)]
        stage = ExpertStage(largest, torch.device(device))
        for provider in providers:
            provider.attach_stage(stage)
    return providers
