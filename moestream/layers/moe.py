"""Sparse Mixture-of-Experts FFN (Qwen3-MoE): softmax router, top-k, SiLU-gated experts.

Expert weights are reached only through an `ExpertProvider`, the seam where the expert-tier
system (GPU slots, host RAM, disk) plugs in: per expert (`weights(e)`), or for the fused kernel
as stacked slots (`stacked()`) read through an `expert_slot` table.

Letters: T tokens, H hidden size, F expert FFN size, E experts, k experts used per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from moestream.kernels import ops
from moestream.layers.linear import linear, needs_host_table
from moestream.layers.mlp import gated_mlp
from moestream.layers.norm import on_kernel_path, q8_of
from moestream.weights.qtensor import QTensor


class ExpertProvider(Protocol):
    """Where one layer's expert weights come from.

    `weights(e)` returns (gate [F, H], up [F, H], down [H, F]) of expert `e`, in GGUF block
    format on the compute device; they must stay valid until the layer's forward returns.
    """

    @property
    def num_experts(self) -> int: ...

    def weights(self, e: int) -> tuple[QTensor, QTensor, QTensor]: ...


class StackedExperts:
    """All experts of a layer resident, as the stacked [E, out, in] tensors of the file."""

    def __init__(self, gate_exps: QTensor, up_exps: QTensor, down_exps: QTensor):
        if not (gate_exps.shape[0] == up_exps.shape[0] == down_exps.shape[0]):
            raise ValueError("gate, up and down stacks hold different expert counts")
        self.gate_exps, self.up_exps, self.down_exps = gate_exps, up_exps, down_exps
        # Identity expert -> slot table for the fused kernel: every expert is resident.
        self.expert_slot = torch.arange(
            gate_exps.shape[0], dtype=torch.int32, device=gate_exps.device
        )
        # Per-expert views, made once (slicing a QTensor validates it: not free per call).
        self.refresh_views()

    @property
    def num_experts(self) -> int:
        return self.gate_exps.shape[0]

    def weights(self, e: int) -> tuple[QTensor, QTensor, QTensor]:
        return self._views[e]

    def refresh_views(self) -> None:
        """Remake the per-expert views, e.g. after the stacks got cached values
        (`QTensor.values`), which a view then shares."""
        self._views = [
            (self.gate_exps[e], self.up_exps[e], self.down_exps[e]) for e in range(self.num_experts)
        ]

    def stacked(self) -> tuple[QTensor, QTensor, QTensor]:
        return self.gate_exps, self.up_exps, self.down_exps


def route(
    x: torch.Tensor,
    router: QTensor,
    top_k: int,
    norm_topk_prob: bool,
    counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> routing weights [T, k] float32 and expert ids [T, k] int64.

    Router logits and softmax in float32; the top-k probabilities are renormalised to sum to 1
    when `norm_topk_prob`. torch.topk breaks ties by the lower index, deterministically. On the
    kernel path with a float router weight (F32, F16, BF16) up to `kernels.router.ROUTER_MAX_T`
    tokens (any number in batch-invariant mode, in chunks of that many) logits, softmax, top-k
    and renormalisation are one launch (`kernels.router.fused_route`; `counters` its arrival
    counters, made per call when None); otherwise a matmul for the logits, then softmax, top-k
    and renormalisation in one launch (`kernels.router.topk_softmax`).
    """
    if on_kernel_path(x) and _float_router(x, router):
        from moestream.kernels.router import ROUTER_MAX_T, fused_route, route_counters

        t = x.shape[0]
        if t <= ROUTER_MAX_T or ops.batch_invariant_enabled():
            x = x if x.stride(-1) == 1 else x.contiguous()
            if counters is None:
                counters = route_counters(x.device)
            parts = [
                fused_route(x[i : i + ROUTER_MAX_T], router.data, top_k, norm_topk_prob, counters)
                for i in range(0, max(t, 1), ROUTER_MAX_T)
            ]
            if len(parts) == 1:
                return parts[0]
            return torch.cat([w for w, _ in parts]), torch.cat([i for _, i in parts])
    logits = linear(x.float(), router)  # [T, E] float32
    if on_kernel_path(logits):
        from moestream.kernels.router import topk_softmax

        return topk_softmax(logits, top_k, norm_topk_prob)
    return topk_softmax_ref(logits, top_k, norm_topk_prob)


def _float_router(x: torch.Tensor, router: QTensor) -> bool:
    """A router weight `kernels.router.fused_route` reads: F32, F16 or BF16, contiguous, on x's
    device."""
    return (
        router.is_float
        and router.data.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and router.data.dim() == 2
        and router.data.is_contiguous()
        and router.device == x.device
        and x.dim() == 2
    )


def topk_softmax_ref(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `kernels.router.topk_softmax` (same signature): logits [T, E] -> weights
    [T, k] float32 (softmax probabilities, renormalised when asked) and expert ids [T, k] int64,
    most probable first."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def graphable_experts(router: QTensor, stacked: Sequence[QTensor]) -> bool:
    """Whether a router and expert stacks (gate, up, down) run without the host on the kernel
    path: no host table for the router, every stack of a kernel type and group-aligned."""
    return not needs_host_table(router) and all(
        w.qtype in ops.KERNEL_QTYPES and w.shape[-1] % ops.KERNEL_GROUP == 0 for w in stacked
    )


def fused_moe_path(x: torch.Tensor) -> bool:
    """Whether `SparseMoE` runs the routed experts of activation `x` as one `ops.moe_forward`
    call over stacked weights and an `expert_slot` table (everywhere but the CPU, where the
    per-expert path is the batch-invariant one: `layers.linear`)."""
    return x.device.type != "cpu"


def moe_rows_independent(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor) -> bool:
    """Whether row t of `ops.moe_forward(x, ids, weights, gate, up, down, slot)` depends only on
    (x[t], ids[t], weights[t]) and the shapes, not on the other rows' routing. True exactly when
    it takes the fused Triton kernel (`ops.moe_kernel_path`): its method and tiles
    follow T*k and E only, and rows never mix. Not of the torch reference, whose BLAS calls
    vary with the rows per expert. The streamed layer relies on it to run a batch in passes
    over subsets of its experts and get the one-pass result bit for bit."""
    return ops.moe_kernel_path(x, gate, up, down)


class SparseMoE:
    """Routed experts of one layer.

    Fused path (`fused_moe_path`: off the CPU): one `ops.moe_forward` call over the provider's
    stacked weights and `expert_slot` table, with no host sync when every expert is resident.
    Per-expert path (the CPU, and streamed experts that do not fit the device slots): tokens
    are grouped by expert and only the experts that some token selected are run, in ascending
    expert order, each token's outputs summed in that order (deterministic; one host sync for
    the per-expert counts)."""

    def __init__(self, router: QTensor, experts: ExpertProvider, top_k: int, norm_topk_prob: bool):
        if router.shape[0] != experts.num_experts:
            raise ValueError(
                f"router has {router.shape[0]} outputs for {experts.num_experts} experts"
            )
        self.router = router  # [E, H]
        self.experts = experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        # The fused router's arrival counters (`kernels.router.fused_route`), kept so that a
        # step makes none (no launch to zero them; a CUDA graph replays with them).
        self.route_counters: torch.Tensor | None = None
        if router.device.type == "cuda" and ops.HAS_TRITON:
            from moestream.kernels.router import route_counters

            self.route_counters = route_counters(router.device)
        # Likewise for the fused experts' epilogues (`kernels.moe_mmvq.mmvq_counters`), made at
        # the first fused call (the eager step before any graph capture).
        self._moe_counters: torch.Tensor | None = None

    @property
    def resident(self) -> bool:
        """Every expert sits in a fixed slot (the file's stacks, or a store layer holding them
        all): the fused path then needs nothing from the host."""
        return isinstance(self.experts, StackedExperts) or bool(
            getattr(self.experts, "fully_resident", False)
        )

    @property
    def capturable(self) -> bool:
        """The forward has no host sync on CUDA (the fused kernel over resident experts), so a
        CUDA graph can capture it. Providers that stream experts are not capturable."""
        if not self.resident:
            return False
        return graphable_experts(self.router, self.experts.stacked())  # type: ignore[attr-defined]

    def takes_q8(self, x: torch.Tensor) -> bool:
        """Whether the forward on x [T, H] rounds x to q8 blocks (the fused kernel's integer-dot
        path over the provider's slots): the norm producing x can then do it (`norm.with_q8`)."""
        zero_copy = getattr(self.experts, "expert_addr", None) is not None
        if zero_copy or not fused_moe_path(x) or not self.resident:
            return False
        gate, up, down = self.experts.stacked()  # type: ignore[attr-defined]
        return ops.moe_takes_q8(x, self.top_k, gate, up, down, self.experts.num_experts)

    def _counters(self, x: torch.Tensor, gate: QTensor) -> torch.Tensor | None:
        """The fused kernel's arrival counters on CUDA, made at the first call (the eager step
        before any graph capture) and kept."""
        if x.device.type != "cuda":
            return None
        if self._moe_counters is None:
            from moestream.kernels.moe import MMVQ_MAX_ASSIGNMENTS
            from moestream.kernels.moe_mmvq import mmvq_counters

            self._moe_counters = mmvq_counters(
                MMVQ_MAX_ASSIGNMENTS, gate.shape[1], x.device, gate.shape[2], self.top_k
            )
        return self._moe_counters

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H] in x's dtype."""
        weights, ids = route(
            x, self.router, self.top_k, self.norm_topk_prob, self.route_counters
        )  # [T, k]
        return self.forward_routed(x, weights, ids)

    def forward_routed(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        expert_slot: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The experts of routing (weights [T, k] float32, ids [T, k] int, from `route`) on
        x [T, H] -> [T, H] in x's dtype.

        With `expert_slot` [E] int32 (the caller has pinned every expert `ids` names into the
        provider's slots, and the table maps them): one `ops.moe_forward` over the provider's
        `stacked()` slots. Without: the fused call when `fused_moe_path(x)` and the experts are
        resident (the provider's own table; no host sync), else the per-expert path. The fused
        call takes the q8 rounding of x that its norm attached (`norm.q8_of`), if any."""
        if getattr(self.experts, "paged", False):  # `experts.paged.PagedExperts`
            paged: Any = self.experts
            if fused_moe_path(x):  # routed experts paged into slots (or gathered), queued
                gate, up, down, slot = paged.prepare(ids)
                paged.predict(x)  # the next layer's experts, paged meanwhile on a side stream
                xa, counters = q8_of(x), self._counters(x, gate)
                return ops.moe_forward(x, ids, weights, gate, up, down, slot, xa, counters)
            paged.observe(ids)  # the CPU: paged by torch, then the per-expert path
            paged.predict(x)
        elif getattr(self.experts, "expert_addr", None) is not None:  # zero-copy placement
            experts: Any = self.experts  # `experts.zero_copy.ZeroCopyExperts`
            if not fused_moe_path(x):
                experts.observe(ids)
            else:  # long forwards read the host tier from the prefill stage, if there is one
                addr, staged = experts.addresses(x.shape[0])
                experts.observe(ids, staged)
                gate, up, down = experts.stacked()
                work = experts.host_work
                marks = experts.host_marks if work else None  # the launch shape of host work
                return ops.moe_forward_addr(
                    x, ids, weights, gate, up, down, addr, None if staged else work, marks
                )
        elif expert_slot is None and fused_moe_path(x) and self.resident:
            expert_slot = self.experts.expert_slot  # type: ignore[attr-defined]
        if expert_slot is not None:
            gate, up, down = self.experts.stacked()  # type: ignore[attr-defined]
            xa = q8_of(x)  # the norm's q8 rounding of x, if it made one
            counters = self._counters(x, gate)
            return ops.moe_forward(x, ids, weights, gate, up, down, expert_slot, xa, counters)
        flat_ids = ids.flatten()  # [T*k]
        order = torch.argsort(flat_ids, stable=True)  # assignments grouped by expert
        token_of = order // self.top_k  # [T*k] token of each grouped assignment
        weight_of = weights.flatten()[order]  # [T*k]
        counts = torch.bincount(flat_ids, minlength=self.experts.num_experts).tolist()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tokens = token_of[start : start + n]  # [n]
            gate, up, down = self.experts.weights(e)
            y = gated_mlp(x[tokens], gate, up, down)  # [n, H]
            out.index_add_(0, tokens, y.float() * weight_of[start : start + n, None])
            start += n
        return out.to(x.dtype)
