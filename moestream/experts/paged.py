"""Paged expert placement: every expert in pinned host memory, the routed ones paged into device
slots by the GPU itself, so a decode step with experts outside the device is one CUDA graph.

The streamed path (`prefetch.StreamedMoE`) reads each layer's routing on the host to load what
is missing: a decode step becomes a chain of graphs with the host's work between the pieces
(~120 us a layer on the 30B: bench/RESULTS.md, twentieth session), which bounds it far above the
GPU's own time. Zero-copy placement (`experts.zero_copy`) needs no host, but its placement
follows the routing only every `expert_rebalance_steps` steps, so every routed host expert
crosses the link at every use. Here the decision moves onto the device
(`kernels.expert_pager`): before each forward of a layer of up to `PAGE_MAX_TOKENS` tokens,
one program admits the routed experts that are not in slots into the slots of the coldest
unrouted ones (frequency over a sliding window of forwards: a decayed count,
`HEAT_HALF_LIFE`), a grid copies them from host memory, and the slot table is rewritten; no
host synchronisation, no host work, and the kernels are captured with the rest of the step. The
host tier is inclusive (all experts), so an evicted expert needs no copy back.

The layer then runs the same fused MoE call as a resident layer (`ops.moe_forward` over a stack
and an expert-to-slot table), so its method and bits are the resident model's at every batch:
- over the device slots when every routed expert is in one after paging (the forward pages
  and T x k <= S, so the free slots cover what is missing);
- else (prefill chunks, batches beyond the slots) over the stage, a stack of E slots shared by
  the layers (on CUDA, out of the device budget), into which a gather copies the forward's
  routed experts in expert order from wherever they are (slots at device speed, the rest across
  the link). Longer forwards do not page and do not heat experts: decode steps decide what
  stays.

Each layer also predicts the next MoE layer's experts (`PagedExperts.predict`: the next router
applied to its own FFN input) and pages those missing from the next layer's slots on a side
stream, so that the copies overlap its own compute; the next layer's paging waits for them,
scores the prediction (named, then routed) and keeps prefetching only while at least
`PREFETCH_MIN_PRECISION` of what predictions name is routed (`kernels.expert_pager`).

Off CUDA (tests), `page_ref` makes the same decisions in torch and the layer takes the
per-expert path through `weights(e)`.

Letters: E experts, S device slots per layer, T tokens, k experts per token.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from gguf import GGMLQuantizationType
from tqdm import tqdm

from moestream.errors import CapacityError, UnsupportedError
from moestream.experts.counters import phase_of
from moestream.experts.zero_copy import ExpertStage, TwoTierStacks
from moestream.weights.qtensor import QTensor

if TYPE_CHECKING:
    from moestream.types import StepPlan

# The device counters of each layer and phase (`kernels.expert_pager`'s stats, in this order):
# reads by where they were served; admissions; experts a prediction named outside the slots,
# and of those routed; experts prefetched, and of those routed.
STATS = (
    "slot_reads", "admitted_reads", "link_reads", "admissions",
    "predicted", "predicted_used", "prefetched", "prefetched_used",
)  # fmt: skip
# Forwards of up to this many tokens page (decode and verify batches); longer ones (prefill
# chunks, which route to most experts) gather what they read into the stage without paging.
PAGE_MAX_TOKENS = 32
# Forwards after which an expert's heat halves: routing reuse is cyclic over a few hundred tokens
# (the streamed store's window policy counts the last 256 tokens).
HEAT_HALF_LIFE = 128
PHASES = ("prefill", "decode")
# A prediction is prefetched while at least this share of the experts that predictions named
# outside the slots (over recent forwards, decayed like the heat) was then routed: a wrong
# prefetch costs a copy over the link and evicts an expert.
PREFETCH_MIN_PRECISION = 0.5
# The gate's start, [named, routed]: as if this many experts had been named and none routed, so
# that predictions are prefetched once they have shown their precision (the synth 30B's
# predictions, 30% precise, prefetched 23 experts a layer while an empty gate stayed open:
# bench/RESULTS.md), a dozen forwards in at 85% precision.
GATE_PRIOR = (8.0, 0.0)


class PhaseRow:
    """Which row of the layers' counters a forward adds to, by the phase of its step
    (`counters.phase_of`; the engine calls `enter_step` before each forward). Forwards
    captured in CUDA graphs count as decode (`PagedExperts._stats`)."""

    def __init__(self) -> None:
        self.row = PHASES.index("decode")

    def enter_step(self, plan: StepPlan) -> None:
        self.row = PHASES.index(phase_of(plan))


class PagedExperts(TwoTierStacks):
    """The `ExpertProvider` of one layer under paged placement (module docstring)."""

    # the fused path needs nothing from the host: CUDA graphs capture the paging with the layer
    fully_resident = True
    paged = True  # `layers.moe.SparseMoE` asks `prepare` for the stacks and the slot table

    def __init__(
        self,
        stacks: Sequence[QTensor],
        n_slots: int,
        device: torch.device | str,
        stage: ExpertStage | None = None,
        phase: PhaseRow | None = None,
    ):
        gate, up, down = stacks  # [E, F, H], [E, F, H], [E, H, F] (host, file layout)
        e = gate.shape[0]
        if not 1 <= n_slots <= e:
            raise ValueError(f"n_slots {n_slots} not in [1, {e}]")
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
        nbytes = [w.data[0].numel() for w in self._host]  # one expert's gate, up, down
        self._expert_bytes = sum(nbytes)
        if any(n % 16 for n in nbytes) or any(w.data.data_ptr() % 16 for w in self._dev):
            raise UnsupportedError("expert byte sizes are not multiples of 16: no paging")
        self._words = tuple(n // 4 for n in nbytes)
        ptr = self.device.type
        self.host_addr = self._addresses(self._host, e)  # [3, E]
        self.slot_addr = self._addresses(self._dev, n_slots)  # [3, S]
        self.addr = self.host_addr.clone()  # [3, E] where each expert is now
        self.addr[:, :n_slots] = self.slot_addr
        self.slot_of = torch.full((e,), -1, dtype=torch.int32, device=ptr)  # [E] slot or -1
        self.slot_of[:n_slots] = torch.arange(n_slots, dtype=torch.int32)
        self.owner = torch.arange(n_slots, dtype=torch.int32, device=ptr)  # [S] expert or -1
        self.heat = torch.zeros(e, dtype=torch.float32, device=ptr)
        # a row per phase, and one that capture warm-ups (padding rows) count into, unread
        self.stats = torch.zeros(len(PHASES) + 1, len(STATS), dtype=torch.int64, device=ptr)
        # The prediction of this layer's next forward (made by the MoE layer before, `predict`):
        # the experts it named outside the slots (1) or prefetched (2), scored and cleared by
        # the forward's own paging; and [named, routed] over recent forwards, decayed (its gate).
        self.mark = torch.zeros(e, dtype=torch.int8, device=ptr)
        self.gate = torch.tensor(GATE_PRIOR, dtype=torch.float32, device=ptr)
        # The next MoE layer and its router (`attach_paged`): this layer predicts its experts.
        self.next: PagedExperts | None = None
        self.next_router: QTensor | None = None
        self.top_k = 0
        self._pending: tuple[Any, ...] | None = None  # a queued prediction: (stream, tensors)
        self.phase = phase or PhaseRow()
        self._copies = torch.zeros(1 + 2 * e, dtype=torch.int32, device=ptr)  # kernels' lists
        self.decay = 0.5 ** (1.0 / HEAT_HALF_LIFE)
        # The stage: a stack of E slots (shared by the layers) for forwards whose routed experts
        # may not all fit the slots; `stage_slot` maps each routed expert to its stage slot.
        self._stage: list[QTensor] = []
        if stage is not None:
            self._stage = [
                QTensor(stage.view(k, w.data), w.qtype, w.shape) for k, w in enumerate(self._host)
            ]
        self.stage_addr = self._addresses(self._stage, e) if stage is not None else None
        self.stage_slot = torch.zeros(e, dtype=torch.int32, device=ptr)  # [E]

    def _addresses(self, stacks: Sequence[QTensor], n: int) -> torch.Tensor:
        """[3, n] int64: the byte address of each slot of the three stacks."""
        rows = [[w.data[i].data_ptr() for i in range(n)] for w in stacks]
        return torch.tensor(rows, dtype=torch.int64).to(self.device.type)

    # ---- paging ------------------------------------------------------------------------------
    def _stats(self) -> torch.Tensor:
        if self.device.type != "cuda":
            return self.stats[self.phase.row]
        from moestream.runner.cuda_graph import captured_phase, warming_up

        if warming_up():  # a capture's warm-up: padding rows, not a step
            return self.stats[len(PHASES)]
        if torch.cuda.is_current_stream_capturing():  # the phase of the steps it will run (a
            # decode graph may be captured after a prompt's eager step)
            return self.stats[PHASES.index(captured_phase())]
        return self.stats[self.phase.row]

    def _page(self, ids: torch.Tensor, admit: bool, predict: bool = False) -> None:
        from moestream.kernels.expert_pager import page

        page(
            ids, self.heat, self.slot_of, self.owner, self.addr, self.host_addr, self.slot_addr,
            self._copies, self._stats(), self.mark, self.gate, self._words, self.decay, admit,
            predict, PREFETCH_MIN_PRECISION, _prefetch_programs(self.device) if predict else None,
        )  # fmt: skip

    def prepare(self, ids: torch.Tensor) -> tuple[QTensor, QTensor, QTensor, torch.Tensor]:
        """(gate, up, down stacks, expert-to-slot table [E] int32) holding every expert that ids
        [T, k] routes to, for one fused MoE call (`ops.moe_forward`): the device slots when
        every expert has one, or after paging when the forward pages and T x k <= S (the free
        slots then cover the missing experts); else the stage after a gather (module
        docstring). Everything is queued on the current stream (CUDA), after the prediction's
        prefetch for this forward, if one is queued (`predict`)."""
        from moestream.kernels.expert_pager import gather

        slots = (*self._dev, self.slot_of)
        if self.n_slots == self.num_experts:  # every expert in a slot: nothing to page
            return slots  # type: ignore[return-value]
        if self._pending is not None:  # the prefetch wrote the tables and slots: join it
            torch.cuda.current_stream(self.device).wait_stream(self._pending[0])
            self._pending = None
        admit = ids.shape[0] <= PAGE_MAX_TOKENS
        self._page(ids, admit)
        if admit and ids.numel() <= self.n_slots:
            return slots  # type: ignore[return-value]
        if self.stage_addr is None:
            raise ValueError("this layer has no stage: a forward beyond its slots cannot run")
        gather(ids, self.addr, self.stage_addr, self.stage_slot, self._copies, self._words)
        return (*self._stage, self.stage_slot)  # type: ignore[return-value]

    def observe(self, ids: torch.Tensor) -> None:
        """The CPU's paging (`page_ref`: the same decisions, bytes copied by torch) for a
        forward routed to ids [T, k]; its per-expert path then reads `weights(e)`."""
        admit = ids.shape[0] <= PAGE_MAX_TOKENS
        self._move(self._page_ref(ids, admit))

    def _page_ref(self, ids: torch.Tensor, admit: bool, predict: bool = False) -> list:
        return page_ref(
            ids, self.heat, self.slot_of, self.owner, self._stats(), self.decay, admit,
            self.mark, self.gate, predict,
        )  # fmt: skip

    def _move(self, moves: list[tuple[int, int]]) -> None:
        for e, s in moves:
            for k in range(3):
                self._dev[k].data[s].copy_(self._host[k].data[e])

    def predict(self, x: torch.Tensor) -> None:
        """Predict the next MoE layer's experts for the forward of x [T, H] (this layer's FFN
        input, the next layer's router applied to it: consecutive layers' hidden states are
        close) and page them into its slots while the prediction pays (`page`'s gate). On CUDA
        it is queued on a side stream after what the current stream has queued, so that the
        copies overlap this layer's compute; the next layer's `prepare` waits for it. Forwards
        that the slots serve only (tokens x k <= slots, up to `PAGE_MAX_TOKENS` tokens): longer
        ones read a stage, and name so many experts that they would open the gate for the
        forwards after them (a 32-token prompt of the synth 30B: 78% of the experts named were
        routed, against 30% a decode token; bench/RESULTS.md)."""
        nxt, router = self.next, self.next_router
        if nxt is None or router is None or x.shape[0] > PAGE_MAX_TOKENS:
            return
        if x.shape[0] * self.top_k > nxt.n_slots or nxt.n_slots == nxt.num_experts:
            return
        from moestream.layers.moe import route

        if self.device.type != "cuda":
            nxt._move(nxt._page_ref(route(x, router, self.top_k, False)[1], True, predict=True))
            return
        side, counters = _prediction_stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            ids = route(x, router, self.top_k, False, counters)[1]
            nxt._page(ids, True, predict=True)
        nxt._pending = (side, x, ids)  # kept until the join: the side stream reads them

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
        """The device slots' stacks (types, shapes and row strides of the fused kernel)."""
        return tuple(self._dev)

    def held(self) -> list[int]:
        """The experts in device slots now, by slot (-1: empty); one device sync."""
        return self.owner.tolist()


@functools.cache
def _prediction_stream(device: torch.device) -> tuple[torch.cuda.Stream, torch.Tensor | None]:
    """The stream that predictions are routed and paged on, one a device (so one prediction
    at a time), and the router arrival counters its launches share (`attach_paged` makes them
    before any graph capture)."""
    from moestream.kernels import ops

    counters = None
    if ops.HAS_TRITON:
        from moestream.kernels.router import route_counters

        counters = route_counters(device)
    return torch.cuda.Stream(device), counters


@functools.cache
def _prefetch_programs(device: torch.device) -> int:
    """The prefetch's copy grid: a program a SM, leaving room for the compute it overlaps (1 to
    8 programs a SM copied within 1% of each other: bench/RESULTS.md, twenty-first session)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_snapshot(providers: Sequence[PagedExperts]) -> dict[str, Any]:
    """Reads by where they came from over all layers so far (one device sync): slots that held
    the expert, slots it was admitted to for that forward, host memory (across the link into
    the stage); admissions and the bytes they copied; the predictions' experts named outside
    the slots and prefetched, with the shares of each that were routed (precision, prefetch
    accuracy) and the bytes prefetched; the bytes over the host link; the share of reads
    served from device slots and the share found already in slots (the hit rate); the same
    per phase under "phases"."""
    if not providers:
        return {}
    # [layer, phase, counter] (not the warm-ups' row)
    stats = torch.stack([p.stats[: len(PHASES)] for p in providers]).cpu()
    per = torch.tensor([p.expert_bytes for p in providers], dtype=torch.int64)
    # each layer's admissions, link reads and prefetches at its own expert size: [phase, 3]
    moved = (stats[:, :, [3, 2, 6]] * per[:, None, None]).sum(0)
    rows = stats.sum(0)  # [phase, counter]

    def rates(counts: torch.Tensor, nbytes: torch.Tensor) -> dict[str, Any]:
        return _rates(dict(zip(STATS, counts.tolist(), strict=True)), *nbytes.tolist())

    out = rates(rows.sum(0), moved.sum(0))
    out["phases"] = {ph: rates(rows[i], moved[i]) for i, ph in enumerate(PHASES)}
    return out


def _rates(
    c: dict[str, int], admitted_bytes: int, link_read_bytes: int, prefetched_bytes: int
) -> dict[str, Any]:
    device = c["slot_reads"] + c["admitted_reads"]
    total = device + c["link_reads"]

    def share(a: int, b: int) -> float:
        return a / b if b else 0.0

    return {
        **c,
        "admitted_bytes": admitted_bytes,
        "prefetched_bytes": prefetched_bytes,
        # the copies (paged and prefetched) and the reads across
        "link_bytes": admitted_bytes + link_read_bytes + prefetched_bytes,
        "device_read_share": share(device, total),
        "slot_hit_rate": share(c["slot_reads"], total),
        "prediction_precision": share(c["predicted_used"], c["predicted"]),
        "prefetch_accuracy": share(c["prefetched_used"], c["prefetched"]),
    }


def paged_metric_families(
    snapshot: dict[str, float | int],
) -> Iterator[tuple[str, str, str, float]]:
    """(name, help, type, value) for Prometheus from a `paged_snapshot`."""
    docs = {
        "slot_reads": "Expert reads served by device slots that already held the expert",
        "admitted_reads": "Expert reads served by slots the expert was paged into that forward",
        "link_reads": "Expert reads from host memory over the link (not paged into a slot)",
        "admissions": "Experts paged into device slots",
        "admitted_bytes": "Expert bytes paged into device slots",
        "predicted": "Experts that next-layer predictions named outside the device slots",
        "predicted_used": "Experts named by a prediction that the forward then routed",
        "prefetched": "Experts paged into device slots ahead of their layer by a prediction",
        "prefetched_used": "Prefetched experts that the forward then routed",
        "prefetched_bytes": "Expert bytes prefetched into device slots",
        "link_bytes": "Expert bytes over the host link (reads, paging and prefetches)",
    }
    for name, doc in docs.items():
        yield f"moestream_expert_paged_{name}", doc, "counter", float(snapshot[name])
    for name, doc in (
        ("device_read_share", "Share of expert reads served from device memory"),
        ("slot_hit_rate", "Share of paging forwards' expert reads found in slots"),
        ("prefetch_accuracy", "Share of prefetched experts that the forward then routed"),
    ):
        yield f"moestream_expert_paged_{name}", doc, "gauge", float(snapshot[name])


def plan_paging(
    kinds: Sequence[Sequence[tuple[GGMLQuantizationType, int]]],
    n_experts: int,
    gpu_expert_cache_gib: float,
    host_expert_cache_gib: float | None,
    cuda: bool = True,
) -> int:
    """Device slots per layer that paged placement gives, from each MoE layer's (type, bytes of
    one expert) of gate, up and down (`kinds`): the device budget less the stage (one layer's
    experts, shared), in whole slots of every layer. Raises CapacityError when the budget holds
    the stage and no slot a layer, or the host budget (when given) not every expert;
    UnsupportedError when the layers cannot be paged."""
    if cuda:
        from moestream.kernels.expert_pager import MAX_EXPERTS

        if n_experts > MAX_EXPERTS:
            raise UnsupportedError(
                f"paged experts handle up to {MAX_EXPERTS} experts a layer, not {n_experts}"
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
    budget = int(gpu_expert_cache_gib * 2**30)
    if budget >= n_experts * slot:
        return n_experts  # every expert fits: no paging, no stage
    n_slots = max(0, budget - stage) // slot
    if n_slots < 1:
        raise CapacityError(
            f"paged experts need the stage (one layer's experts) and a device slot a layer: "
            f"--gpu-expert-cache-gib {(stage + slot) / 2**30:.3f} or more (got "
            f"{gpu_expert_cache_gib:g})"
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
    predict: bool = True,
) -> list[PagedExperts]:
    """Replace every MoE layer's experts of `model` (built with `defer_expert_tensors`, so its
    stacks are host views of the file) by `PagedExperts` with the device slots per layer of
    `plan_paging` (nothing is replaced when it raises) and, on CUDA, one stage shared by the
    layers. All experts go to pinned host memory. With `predict`, each layer predicts the next
    one's experts (`PagedExperts.predict`)."""
    moes = list(model.moe_layers())  # type: ignore[attr-defined]
    if not moes:
        raise UnsupportedError("paged expert placement applies to MoE models only")
    stacks = [m.experts.stacked() for m in moes]
    kinds = [[(w.qtype, w.data[0].numel()) for w in st] for st in stacks]
    device = torch.device(model.device)  # type: ignore[attr-defined]
    e = stacks[0][0].shape[0]
    cuda = device.type == "cuda"
    n_slots = plan_paging(kinds, e, gpu_expert_cache_gib, host_expert_cache_gib, cuda)
    stage = None
    if cuda and n_slots < e:  # the CPU's per-expert path reads experts where they are
        stage = ExpertStage([max(st[k].data.numel() for st in stacks) for k in range(3)], device)
    providers = []
    phase = PhaseRow()  # shared: one hook sets every layer's counters row
    for moe, st in zip(moes, tqdm(stacks, desc="experts to pinned memory", unit="layer",
                                   disable=None)):  # fmt: skip
        provider = PagedExperts(st, n_slots, device, stage, phase)
        moe.experts = provider
        providers.append(provider)
    if predict and n_slots < e:
        if cuda:
            _prediction_stream(device)  # made now, outside any graph capture
        for i, (moe, provider) in enumerate(zip(moes[:-1], providers[:-1])):
            provider.next, provider.next_router = providers[i + 1], moes[i + 1].router
            provider.top_k = moe.top_k
    return providers


def page_ref(
    ids: torch.Tensor,
    heat: torch.Tensor,
    slot_of: torch.Tensor,
    owner: torch.Tensor,
    stats: torch.Tensor,
    decay: float,
    admit: bool = True,
    mark: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    predict: bool = False,
    min_precision: float = PREFETCH_MIN_PRECISION,
) -> list[tuple[int, int]]:
    """`kernels.expert_pager.page`'s decision in torch, updating heat, slot_of, owner, stats,
    mark and gate in place (mark and gate: the prediction's state, fresh when None); returns
    the admissions as (expert, slot), in the kernel's copy order. The caller moves the bytes."""
    e = slot_of.numel()
    mark = torch.zeros(e, dtype=torch.int8) if mark is None else mark
    gate = torch.tensor(GATE_PRIOR) if gate is None else gate
    cnt = torch.bincount(ids.reshape(-1).long(), minlength=e)[:e].to(torch.int32)
    on_slot = slot_of >= 0
    missing = (cnt > 0) & ~on_slot
    if predict:  # a prediction of the next forward: mark, and prefetch while it pays
        mark.copy_(missing.to(torch.int8))
        stats[4] += int(missing.sum())
        moves = []
        if missing.any() and float(gate[1]) >= min_precision * float(gate[0]):
            moves = _admit_ref(missing, cnt > 0, heat, slot_of, owner)
            mark[[x for x, _ in moves]] = 2
        stats[6] += len(moves)
        return moves
    used = (cnt > 0) & (mark > 0)  # the prediction's experts that this forward routes
    gate.mul_(decay).add_(torch.tensor([float((mark > 0).sum()), float(used.sum())]))
    stats[5] += int(used.sum())
    stats[7] += int((used & (mark == 2)).sum())
    mark.zero_()
    stats[0] += int(cnt[on_slot].sum())
    if not admit:
        stats[2] += int(cnt[missing].sum())
        return []
    heat.mul_(decay).add_(cnt.float())
    moves = _admit_ref(missing, cnt > 0, heat, slot_of, owner)
    hot = torch.nonzero(missing).flatten().tolist()
    admitted = {x for x, _ in moves}
    stats[1] += sum(int(cnt[x]) for x in admitted)
    stats[2] += sum(int(cnt[x]) for x in hot if x not in admitted)
    stats[3] += len(moves)
    return moves


def _admit_ref(
    missing: torch.Tensor,
    named: torch.Tensor,
    heat: torch.Tensor,
    slot_of: torch.Tensor,
    owner: torch.Tensor,
) -> list[tuple[int, int]]:
    """The missing experts, hottest first (ties: lower id), into the slots of the coldest
    experts that `named` does not name (empty slots first; ties: lower slot); tables updated."""
    hot = sorted(torch.nonzero(missing).flatten().tolist(), key=lambda x: (-float(heat[x]), x))
    free = [
        (-1.0 if o < 0 else float(heat[o]), i)
        for i, o in enumerate(owner.tolist())
        if o < 0 or not bool(named[o])
    ]
    free.sort()
    moves = list(zip(hot, (i for _, i in free)))
    for x, i in moves:
        old = int(owner[i])
        if old >= 0:
            slot_of[old] = -1
        slot_of[x] = i
        owner[i] = x
    return moves
