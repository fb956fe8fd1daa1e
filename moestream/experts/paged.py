"""Paged expert placement: every expert in pinned host memory, the routed ones paged into device
slots by the GPU itself, so a decode step with experts outside the device is one CUDA graph.

The streamed path (`prefetch.StreamedMoE`) reads each layer's routing on the host to load what
is missing: a decode step becomes a chain of graphs with the host's work between the pieces
(~120 us a layer on the 30B: bench/RESULTS.md, twentieth session), which bounds it far above the
GPU's own time. Zero-copy placement (`experts.zero_copy`) needs no host, but its placement
follows the routing only every `expert_rebalance_steps` steps, so every routed host expert
crosses the link at every use. Here the decision moves onto the device: before each decode
forward of a layer, `kernels.expert_pager.page` admits the routed experts that are not in
slots into the slots of the coldest unrouted ones (frequency over a sliding window of
forwards: a decayed count, `HEAT_HALF_LIFE`), copies them from host memory with a kernel, and
rewrites the address table that the fused MoE kernel reads; an expert that finds no free slot
(more routed experts than slots) is read across the host link for that forward. No host
synchronisation, no host work: the pager and copy kernels are captured with the rest of the
step. The host tier is inclusive (all experts), so an evicted expert needs no copy back.

Forwards longer than `PAGE_MAX_TOKENS` (prefill chunks) do not page (they route to most
experts: paging would copy the layer through the slots); they read the host experts across the
link or, with a prefill stage (`experts.zero_copy.ExpertStage`, here one whole layer), from a
copy of the layer's host stacks made at the link's DMA rate. Their reads are counted but do not
heat experts: the decode steps' routing alone decides what stays.

Every expert's bytes are the same in every tier and the same kernel reads them, so results never
depend on paging (tests against the resident model). Off CUDA (tests), `page_ref` makes the same
decisions in torch and the layer takes the per-expert path through `weights(e)`.

Letters: E experts, S device slots per layer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from gguf import GGMLQuantizationType
from tqdm import tqdm

from moestream.errors import CapacityError, UnsupportedError
from moestream.experts.counters import phase_of
from moestream.experts.zero_copy import ExpertStage
from moestream.kernels.expert_pager import PAGER_MAX_EXPERTS, STATS, page, page_ref
from moestream.weights.qtensor import QTensor

if TYPE_CHECKING:
    from moestream.types import StepPlan

# Forwards of up to this many tokens page (decode batches: the fused kernel's integer-dot path
# takes 32 tokens of 8 experts in one launch); longer ones read in place.
PAGE_MAX_TOKENS = 32
# Forwards after which an expert's heat halves: routing reuse is cyclic over a few hundred tokens
# (the streamed store's window policy counts the last 256 tokens).
HEAT_HALF_LIFE = 128


PHASES = ("prefill", "decode")


class PhaseRow:
    """Which row of the layers' counters a forward adds to, by the phase of its step
    (`counters.phase_of`; the engine calls `enter_step` before each forward). A CUDA graph
    keeps the row of the step it was captured in: decode graphs count as decode."""

    def __init__(self) -> None:
        self.row = PHASES.index("decode")

    def enter_step(self, plan: StepPlan) -> None:
        self.row = PHASES.index(phase_of(plan))


class PagedExperts:
    """The `ExpertProvider` of one layer under paged placement (module docstring)."""

    # the fused path needs nothing from the host: CUDA graphs capture the paging with the layer
    fully_resident = True
    paged = True  # `layers.moe.SparseMoE`: the decode launch shape, the norm's q8 rows
    host_work = None
    host_marks = None

    def __init__(
        self,
        stacks: Sequence[QTensor],
        n_slots: int,
        device: torch.device | str,
        phase: PhaseRow | None = None,
    ):
        gate, up, down = stacks  # [E, F, H], [E, F, H], [E, H, F] (host, file layout)
        e = gate.shape[0]
        if not 1 <= n_slots <= e:
            raise ValueError(f"n_slots {n_slots} not in [1, {e}]")
        if e > PAGER_MAX_EXPERTS:
            raise UnsupportedError(
                f"paged experts handle up to {PAGER_MAX_EXPERTS} experts a layer, not {e}"
            )
        self.device = torch.device(device)
        self.n_slots = n_slots
        cuda = self.device.type == "cuda"
        self._host: list[QTensor] = []
        self._dev: list[QTensor] = []
        for w in (gate, up, down):
            host = torch.empty(w.data.shape, dtype=w.data.dtype, pin_memory=cuda)  # [E, rows, rb]
            host.copy_(w.data)
            self._host.append(QTensor(host, w.qtype, w.shape))
            dev = torch.empty_like(host[:n_slots], device=self.device)  # [S, rows, rb]
            dev.copy_(host[:n_slots])  # experts 0..S-1 to start (a copy even on the CPU)
            self._dev.append(QTensor(dev, w.qtype, (n_slots, *w.shape[1:])))
        self._expert_bytes = sum(w.data[0].numel() for w in self._host)
        nbytes = [w.data[0].numel() for w in self._host]
        if any(n % 16 for n in nbytes) or any(w.data.data_ptr() % 16 for w in self._dev):
            raise UnsupportedError("expert byte sizes are not multiples of 16: no paging")
        self._words = tuple(n // 4 for n in nbytes)
        ptr = self.device.type
        self.host_addr = torch.tensor(
            [[w.data[i].data_ptr() for i in range(e)] for w in self._host], dtype=torch.int64
        ).to(ptr)  # [3, E]
        self.slot_addr = torch.tensor(
            [[w.data[i].data_ptr() for i in range(n_slots)] for w in self._dev], dtype=torch.int64
        ).to(ptr)  # [3, S]
        self.expert_addr = self.host_addr.clone()  # [3, E] where each expert is read now
        self.expert_addr[:, :n_slots] = self.slot_addr
        self.slot_of = torch.full((e,), -1, dtype=torch.int32, device=ptr)  # [E] slot or -1
        self.slot_of[:n_slots] = torch.arange(n_slots, dtype=torch.int32)
        self.owner = torch.arange(n_slots, dtype=torch.int32, device=ptr)  # [S] expert or -1
        self.heat = torch.zeros(e, dtype=torch.float32, device=ptr)
        self.stats = torch.zeros(len(PHASES), len(STATS), dtype=torch.int64, device=ptr)
        self.phase = phase or PhaseRow()
        self._copies = torch.zeros(1 + 2 * n_slots, dtype=torch.int32, device=ptr)  # scratch
        self.decay = 0.5 ** (1.0 / HEAT_HALF_LIFE)
        # Types, shapes and row strides for the kernel: one slot of each stack.
        self.templates = tuple(
            QTensor(d.data[:1], w.qtype, (1, *w.shape[1:])) for d, w in zip(self._dev, stacks)
        )
        self.stage: ExpertStage | None = None
        self.stage_addr: torch.Tensor | None = None

    # ---- prefill stage -----------------------------------------------------------------------
    def attach_stage(self, stage: ExpertStage) -> None:
        """Read every expert from `stage` (a copy of the layer's host stacks) in forwards longer
        than `PAGE_MAX_TOKENS`."""
        self.stage = stage
        self.stage_addr = torch.tensor(
            [[stage.view(k, w.data)[i].data_ptr() for i in range(self.num_experts)]
             for k, w in enumerate(self._host)],
            dtype=torch.int64, device=self.device,
        )  # fmt: skip

    def addresses(self, tokens: int) -> tuple[torch.Tensor, bool]:
        """(the address table for a forward of `tokens` tokens, whether it is the stage's):
        beyond `PAGE_MAX_TOKENS` with a stage, the layer's host stacks are copied into it now
        (queued on the current stream) and read there; else `expert_addr`."""
        if self.stage is None or self.stage_addr is None or tokens <= PAGE_MAX_TOKENS:
            return self.expert_addr, False
        self.stage.fill([w.data for w in self._host])
        return self.stage_addr, True

    # ---- paging ------------------------------------------------------------------------------
    def observe(self, ids: torch.Tensor, staged: bool = False) -> None:
        """Page for a forward routed to ids [T, k] (module docstring), queued on the current
        stream; forwards of more than `PAGE_MAX_TOKENS` tokens only count their reads."""
        admit = ids.shape[0] <= PAGE_MAX_TOKENS
        # CUDA graphs run decode and verify steps only (a warm-up may capture them after a
        # prompt's eager step: the phase must not come from the step before)
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        stats = self.stats[PHASES.index("decode") if capturing else self.phase.row]
        if self.device.type == "cuda":
            page(
                ids, self.heat, self.slot_of, self.owner, self.expert_addr, self.host_addr,
                self.slot_addr, self._copies, stats, self._words, self.decay, admit, staged,
            )  # fmt: skip
            return
        for e, s in page_ref(ids, self.heat, self.slot_of, self.owner, stats, self.decay, admit,
                             staged):  # fmt: skip
            for k in range(3):
                self._dev[k].data[s].copy_(self._host[k].data[e])
        held = self.owner[self.owner >= 0].long()
        self.expert_addr[:, :] = self.host_addr
        self.expert_addr[:, held] = self.slot_addr[:, self.slot_of[held].long()]

    # ---- ExpertProvider ----------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.slot_of.numel()

    def weights(self, e: int) -> tuple[QTensor, QTensor, QTensor]:
        """Expert e's weights where it is now: its slot, or the host copy (the CPU's path; one
        read of the slot table)."""
        s = int(self.slot_of[e])
        tier, i = (self._dev, s) if s >= 0 else (self._host, e)
        return tuple(QTensor(w.data[i], w.qtype, w.shape[1:]) for w in tier)  # type: ignore[return-value]

    def stacked(self) -> tuple[QTensor, ...]:
        """Types and shapes of the weights (one slot each; the data is found by address)."""
        return self.templates

    def held(self) -> list[int]:
        """The experts in device slots now, by slot (-1: empty); one device sync."""
        return self.owner.tolist()

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (gate, up and down)."""
        return self._expert_bytes

    @property
    def nbytes(self) -> dict[str, int]:
        return {
            "device": sum(w.data.numel() for w in self._dev),
            "host": sum(w.data.numel() for w in self._host),
        }


def paged_snapshot(providers: Sequence[PagedExperts]) -> dict[str, Any]:
    """Reads by where they were served over all layers so far (one device sync): from slots that
    held the expert, from slots it was admitted to for that forward, across the host link, from
    the prefill stage; admissions and the bytes they copied; the share of reads served by the
    device and the share of routed experts found already in slots (the hit rate); the same per
    phase under "phases"."""
    if not providers:
        return {}
    stats = torch.stack([p.stats for p in providers])  # [layer, phase, counter]
    per = torch.tensor([p.expert_bytes for p in providers], dtype=torch.int64)
    # bytes per phase: each layer's admissions and link reads at its own expert size
    moved = (stats[:, :, [3, 2]].cpu() * per[:, None, None]).sum(0).tolist()  # [phase][2]
    rows = stats.sum(0).tolist()  # [phase][counter]
    phases = {
        ph: _rates(dict(zip(STATS, r, strict=True)), *m)
        for ph, r, m in zip(PHASES, rows, moved, strict=True)
    }
    total = {k: sum(phases[ph][k] for ph in PHASES) for k in (*STATS, "admitted_bytes")}
    total["link_bytes"] = sum(phases[ph]["link_bytes"] for ph in PHASES)
    out: dict[str, Any] = _rates(total, total["admitted_bytes"], 0)
    out["link_bytes"] = total["link_bytes"]
    out["phases"] = phases
    return out


def _rates(c: dict[str, int], admitted_bytes: int, link_read_bytes: int) -> dict[str, Any]:
    device = c["slot_reads"] + c["admitted_reads"] + c["stage_reads"]
    total = device + c["link_reads"]
    hit_base = c["slot_reads"] + c["admitted_reads"] + c["link_reads"]
    return {
        **{k: c[k] for k in STATS},
        "admitted_bytes": admitted_bytes,
        "link_bytes": admitted_bytes + link_read_bytes,  # the copies and the reads across
        "device_read_share": device / total if total else 0.0,
        "slot_hit_rate": c["slot_reads"] / hit_base if hit_base else 0.0,
    }


def paged_metric_families(
    snapshot: dict[str, float | int],
) -> Iterator[tuple[str, str, str, float]]:
    """(name, help, type, value) for Prometheus from a `paged_snapshot`."""
    docs = {
        "slot_reads": "Expert reads served by device slots that already held the expert",
        "admitted_reads": "Expert reads served by slots the expert was paged into that forward",
        "link_reads": "Expert reads across the host link (no slot free for them)",
        "stage_reads": "Expert reads of long forwards from the prefill stage",
        "admissions": "Experts paged into device slots",
        "admitted_bytes": "Expert bytes paged into device slots",
        "link_bytes": "Expert bytes over the host link (reads and paging)",
    }
    for name, doc in docs.items():
        yield f"moestream_expert_paged_{name}", doc, "counter", float(snapshot[name])
    for name, doc in (
        ("device_read_share", "Share of expert reads served from device memory"),
        ("slot_hit_rate", "Share of paging forwards' expert reads found in slots"),
    ):
        yield f"moestream_expert_paged_{name}", doc, "gauge", float(snapshot[name])


def plan_paging(
    kinds: Sequence[Sequence[tuple[GGMLQuantizationType, int]]],
    n_experts: int,
    gpu_expert_cache_gib: float,
    host_expert_cache_gib: float | None,
    prefill_stage: bool = False,
    cuda: bool = True,
) -> int:
    """Device slots per layer that paged placement gives, from each MoE layer's (type, bytes of
    one expert) of gate, up and down (`kinds`). Raises CapacityError when the device budget holds
    no slot a layer (with the prefill stage, one layer's experts first) or the host budget (when
    given) not every expert; UnsupportedError when the layers cannot be paged."""
    if n_experts > PAGER_MAX_EXPERTS:
        raise UnsupportedError(
            f"paged experts handle up to {PAGER_MAX_EXPERTS} experts a layer, not {n_experts}"
        )
    if any(n % 16 for layer in kinds for _, n in layer):
        raise UnsupportedError("expert byte sizes are not multiples of 16: no paging")
    if cuda:
        from moestream.kernels.ops import MMVQ_QTYPES

        if not all(q in MMVQ_QTYPES for layer in kinds for q, _ in layer):
            raise UnsupportedError(
                "paged experts on CUDA need the integer-dot MoE kernel's types "
                "(Q4_K, Q5_K, Q6_K, Q8_0)"
            )
    slot = sum(n for layer in kinds for _, n in layer)  # one expert of every layer
    stage = n_experts * max(sum(n for _, n in layer) for layer in kinds)
    budget = int(gpu_expert_cache_gib * 2**30) - (stage if prefill_stage else 0)
    n_slots = min(n_experts, max(0, budget) // slot)
    if n_slots < 1:
        need = slot + (stage if prefill_stage else 0)
        raise CapacityError(
            f"paged experts need at least one device slot a layer: --gpu-expert-cache-gib "
            f"{need / 2**30:.3f} or more (got {gpu_expert_cache_gib:g})"
        )
    host = n_experts * slot
    if host_expert_cache_gib is not None and host > host_expert_cache_gib * 2**30:
        raise CapacityError(
            f"paged placement keeps every expert in pinned host memory ({host / 2**30:.2f} "
            f"GiB), more than --host-expert-cache-gib {host_expert_cache_gib:g}"
        )
    return n_slots


def attach_paged(
    model: object,
    gpu_expert_cache_gib: float,
    host_expert_cache_gib: float | None = None,
    prefill_stage: bool = False,
) -> list[PagedExperts]:
    """Replace every MoE layer's experts of `model` (built with `defer_expert_tensors`, so its
    stacks are host views of the file) by `PagedExperts` with the device slots per layer of
    `plan_paging` (nothing is replaced when it raises). All experts go to pinned host memory."""
    moes = list(model.moe_layers())  # type: ignore[attr-defined]
    if not moes:
        raise UnsupportedError("paged expert placement applies to MoE models only")
    stacks = [m.experts.stacked() for m in moes]
    kinds = [[(w.qtype, w.data[0].numel()) for w in st] for st in stacks]
    device = torch.device(model.device)  # type: ignore[attr-defined]
    e = stacks[0][0].shape[0]
    n_slots = plan_paging(
        kinds, e, gpu_expert_cache_gib, host_expert_cache_gib, prefill_stage,
        device.type == "cuda",
    )  # fmt: skip
    providers = []
    phase = PhaseRow()  # shared: one hook sets every layer's counters row
    for moe, st in zip(moes, tqdm(stacks, desc="experts to pinned memory", unit="layer",
                                   disable=None)):  # fmt: skip
        provider = PagedExperts(st, n_slots, device, phase)
        moe.experts = provider
        providers.append(provider)
    if prefill_stage and n_slots < e:
        largest = [max(p._host[k].data.numel() for p in providers) for k in range(3)]
        stage = ExpertStage(largest, device)
        for provider in providers:
            provider.attach_stage(stage)
    return providers
