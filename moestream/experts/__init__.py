"""Expert tiers: MoE experts in device slots, pinned host RAM and the GGUF file on disk, moved in
as routing needs them. Placement changes speed, never results.

    budgets = ExpertBudgets(gpu_expert_cache_gib=4.0, host_expert_cache_gib=16.0)
    model, store = load_streamed_model("model.gguf", budgets, device="cuda")
    ...                               # run the model as usual
    store.counters.snapshot()         # hits, misses, bytes per tier, prefetch accuracy, stalls

Integration from outside the model code: `build_expert_store` makes the store from the file,
`attach_expert_store` points every MoE layer's `experts` (its `ExpertProvider`) at it and, unless
every expert fits on the device, wraps the layers for batched loads and next-layer prefetch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from moestream.config import ModelConfig
from moestream.errors import CapacityError, UnsupportedError
from moestream.experts.counters import ExpertCounters, metric_families
from moestream.experts.disk import ExpertFileReader, ExpertReadError
from moestream.experts.placement import (
    ExpertBudgets,
    ExpertLayout,
    Placement,
    format_placement,
    placement_summary,
    plan_placement,
    traffic_per_token,
)
from moestream.experts.policy import POLICIES, SlotDirectory, make_policy, simulate
from moestream.experts.prefetch import LayerExperts, StreamedMoE
from moestream.experts.store import ExpertStore
from moestream.weights.qtensor import QTensor

__all__ = [
    "POLICIES",
    "ExpertBudgets",
    "ExpertCounters",
    "ExpertFileReader",
    "ExpertLayout",
    "ExpertReadError",
    "ExpertStore",
    "LayerExperts",
    "Placement",
    "SlotDirectory",
    "StreamedMoE",
    "attach_expert_store",
    "build_expert_store",
    "defer_expert_tensors",
    "describe_placement",
    "detach_expert_store",
    "format_placement",
    "load_streamed_model",
    "make_policy",
    "metric_families",
    "paging_allowed",
    "paging_plan",
    "placement_summary",
    "plan_placement",
    "simulate",
    "traffic_per_token",
]


def _layout_of(source: Any, config: ModelConfig) -> ExpertLayout:
    if getattr(source, "gguf", None) is None:
        raise UnsupportedError(
            f"{source.path}: expert budgets need a GGUF file (experts are read from it by offset)"
        )
    if not config.is_moe:
        raise UnsupportedError(f"{source.path}: expert budgets apply to MoE models only")
    return ExpertLayout.from_gguf(source.gguf, config.n_experts, config.n_experts_used)


def build_expert_store(
    source: Any,
    model_config: ModelConfig,
    budgets: ExpertBudgets,
    device: torch.device | str = "cpu",
    *,
    warm: bool = True,
    **options: Any,
) -> ExpertStore:
    """The expert store of `source` (a `weights.loader.ModelSource` of a GGUF file) for these
    budgets on `device`. `options` go to `ExpertStore` (policy, window, resident_fraction,
    rebalance_every, io_threads, direct). With `warm`, device slots start filled with experts
    0, 1, ... Raises CapacityError when the device budget is below the smallest that runs."""
    layout = _layout_of(source, model_config)
    device = torch.device(device)
    io_threads = int(options.get("io_threads", 4))
    staging = 2 * io_threads + 1 if device.type == "cuda" else 0
    placement = plan_placement(layout, budgets, staging)
    store = ExpertStore(layout, placement, device, **options)
    if warm:
        store.warm()
    return store


def attach_expert_store(model: Any, store: ExpertStore, predict: bool = True) -> None:
    """Serve every MoE layer of `model` (a models.qwen3moe CausalLM) from `store`.

    Replaces each layer's `experts` provider; when some layer streams, also wraps each layer's
    FFN in `StreamedMoE` (batched loads; with `predict`, next-layer pre-gating prefetch)."""
    moes = [m.moe if isinstance(m, StreamedMoE) else m for m in model.moe_layers()]
    if len(moes) != store.layout.n_layers:
        raise ValueError(f"model has {len(moes)} MoE layers, the store {store.layout.n_layers}")
    c = model.config
    want = ((c.expert_ffn_size, c.hidden_size),) * 2 + ((c.hidden_size, c.expert_ffn_size),)
    for i, moe in enumerate(moes):
        if moe.router.shape[0] != store.num_experts:
            raise ValueError(f"layer {i}: {moe.router.shape[0]} experts, store {store.num_experts}")
        shapes = tuple(t.shape for t in store.layout.layers[i])
        if shapes != want:
            raise ValueError(f"layer {i}: store expert shapes {shapes} != the model's {want}")
        moe.experts = store.layers[i]
    streamed = not store.placement.fully_resident
    for i, layer in enumerate(model.layers):
        if streamed:
            nxt = moes[i + 1].router if predict and i + 1 < len(moes) else None
            layer.ffn = StreamedMoE(moes[i], store.layers[i], nxt)
        else:
            layer.ffn = moes[i]


def detach_expert_store(model: Any) -> None:
    """Undo the `StreamedMoE` wrapping (the providers stay the store's)."""
    for layer in model.layers:
        if isinstance(layer.ffn, StreamedMoE):
            layer.ffn = layer.ffn.moe


@dataclasses.dataclass
class _HostQTensor(QTensor):
    """A stacked expert tensor that stays a host view when the model moves weights to its
    device: the store replaces it before any forward."""

    def to(self, device: torch.device | str, aligned: bool = False) -> QTensor:
        return self


class _DeferredExperts(Mapping[str, QTensor]):
    def __init__(self, tensors: Mapping[str, QTensor]):
        self._tensors = tensors

    def __getitem__(self, name: str) -> QTensor:
        t = self._tensors[name]
        if "_exps." in name:
            return _HostQTensor(t.data, t.qtype, t.shape)
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def defer_expert_tensors(source: Any) -> Any:
    """A copy of `source` (ModelSource) whose stacked expert tensors are not moved to the
    device by `build_model` (they stay zero-copy views of the file's memory map)."""
    return dataclasses.replace(source, tensors=_DeferredExperts(source.tensors))


def load_streamed_model(
    path: str | Path,
    budgets: ExpertBudgets,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    **options: Any,
) -> tuple[Any, ExpertStore]:
    """(model, store): the model of a GGUF file with its experts served by a store under
    `budgets` (see `build_expert_store` for `options`; `predict` goes to attach)."""
    from moestream.models.registry import build_model
    from moestream.weights.loader import open_model

    predict = options.pop("predict", True)
    source = open_model(path)
    store = build_expert_store(source, source.config, budgets, device, **options)
    model = build_model(defer_expert_tensors(source), device=device, dtype=dtype)
    attach_expert_store(model, store, predict=predict)
    return model, store


def paging_plan(
    source: Any, config: ModelConfig, budgets: ExpertBudgets, cuda: bool = True
) -> tuple[int | None, str | None]:
    """(device slots per layer, None) when paged placement (`experts.paged`) can run these
    budgets on the file of `source`, else (None, why not); reads no weights."""
    from moestream.experts.paged import plan_paging

    if budgets.gpu_expert_cache_gib is None:
        return None, "every expert is resident"
    try:
        layout = _layout_of(source, config)
        kinds = [[(t.qtype, t.expert_bytes) for t in layer] for layer in layout.layers]
        slots = plan_paging(
            kinds, layout.n_experts, budgets.gpu_expert_cache_gib,
            budgets.host_expert_cache_gib, cuda,
        )  # fmt: skip
    except (CapacityError, UnsupportedError) as e:
        return None, str(e)
    return slots, None


def paging_allowed(
    source: Any, config: ModelConfig, budgets: ExpertBudgets, cuda: bool = True
) -> bool:
    """Whether paged placement can run these budgets (`paging_plan`) with something to page:
    when every expert fits the device budget the store keeps them all resident instead."""
    slots = paging_plan(source, config, budgets, cuda)[0]
    return slots is not None and slots < config.n_experts


def describe_placement(
    path: str | Path,
    budgets: ExpertBudgets,
    device_hit_rate: float | None = None,
    host_hit_rate: float | None = None,
    staging_experts: int = 0,
) -> dict[str, Any]:
    """`moestream info MODEL --budgets`: the placement these budgets give (no weights are
    read) as `placement_summary` data; `format_placement` renders it."""
    from moestream.runner.cuda_graph import BUCKETS, buckets_up_to
    from moestream.weights.loader import open_model

    source = open_model(path)
    layout = _layout_of(source, source.config)
    placement = plan_placement(layout, budgets, staging_experts)
    summary = placement_summary(layout, placement, device_hit_rate, host_hit_rate)
    # On CUDA, decode steps of up to this many requests run as chains of graphs (their routed
    # experts always fit every streamed layer's slots: `StreamedMoE.graph_tokens`; at least 1,
    # every layer holding top_k); None: no layer streams (whole graphs at every bucket).
    streamed = [d // layout.top_k for d in placement.device_slots if d < layout.n_experts]
    summary["graph_batch"] = max(buckets_up_to(BUCKETS, min(streamed))) if streamed else None
    # On CUDA the default is paged placement where these budgets allow it (`LLM`)
    slots, refused = paging_plan(source, source.config, budgets)
    if slots == layout.n_experts:
        slots, refused = None, "every expert fits the device budget"
    summary["paged_slots"], summary["paged_refused"] = slots, refused
    if slots is not None:  # a decode token's misses cross the link once, into their slots
        hit = device_hit_rate if device_hit_rate is not None else slots / layout.n_experts
        summary["paged_bytes_per_token"] = layout.top_k * layout.slot_bytes * (1.0 - hit)
    return summary
