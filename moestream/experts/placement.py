"""Expert budgets, where each expert's bytes sit in the GGUF file, and the placement a budget
gives: how many experts of each layer the device slots and the host tier hold.

Pure Python (no torch): `moestream info MODEL --budgets` uses it without loading a model.

Budgets count expert bytes only; the non-routed weights (attention, norms, router, embeddings)
are always resident and come on top. The device budget is split across layers in whole experts:
every layer gets the same number of slots, at least `top_k` (one token's experts must be in place
together) and at most `n_experts`, and what is left goes one slot at a time to the first layers.
The host tier (pinned RAM on CUDA) is an inclusive cache between the file and the device, only
for layers whose device slots do not hold every expert; on CUDA it also pays for the pinned
staging buffers of the disk reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType

from moestream.errors import CapacityError, ModelFormatError, RequestError

GIB = 2**30
KINDS = ("gate", "up", "down")
TENSOR_OF_KIND = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}


@dataclass(frozen=True)
class ExpertBudgets:
    """Expert cache budgets in GiB. `gpu_expert_cache_gib=None` keeps every expert resident on
    the device (no streaming); a value turns on the store. `host_expert_cache_gib` is the host
    tier (pinned when the device is CUDA); the rest is read from the GGUF file on disk."""

    gpu_expert_cache_gib: float | None = None
    host_expert_cache_gib: float = 0.0

    def __post_init__(self) -> None:
        gpu, host = self.gpu_expert_cache_gib, self.host_expert_cache_gib
        if gpu is not None and not (gpu > 0 and math.isfinite(gpu)):
            raise RequestError(f"--gpu-expert-cache-gib must be a positive number, got {gpu}")
        if not (host >= 0 and math.isfinite(host)):
            raise RequestError(f"--host-expert-cache-gib must be >= 0, got {host}")

    @property
    def streaming(self) -> bool:
        return self.gpu_expert_cache_gib is not None

    @property
    def device_bytes(self) -> int:
        return int((self.gpu_expert_cache_gib or 0.0) * GIB)

    @property
    def host_bytes(self) -> int:
        return int(self.host_expert_cache_gib * GIB)


@dataclass(frozen=True)
class ExpertTensor:
    """One stacked expert tensor of one layer (e.g. blk.3.ffn_gate_exps.weight) in the file.
    Expert e's bytes are the contiguous range [offset(e), offset(e) + expert_bytes)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # one expert's logical shape, torch order: (out, in)
    data_offset: int  # absolute file offset of expert 0
    expert_bytes: int

    def offset(self, e: int) -> int:
        return self.data_offset + e * self.expert_bytes


@dataclass(frozen=True)
class ExpertLayout:
    """Every MoE layer's (gate, up, down) stacked tensors in a GGUF file."""

    path: Path
    n_experts: int
    top_k: int
    layers: tuple[tuple[ExpertTensor, ExpertTensor, ExpertTensor], ...]

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def expert_bytes(self, layer: int) -> int:
        """Bytes of one expert of `layer` (gate + up + down)."""
        return sum(t.expert_bytes for t in self.layers[layer])

    @property
    def slot_bytes(self) -> int:
        """Bytes of one expert in every layer: what a budget pays per slot a layer."""
        return sum(self.expert_bytes(i) for i in range(self.n_layers))

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes * self.n_experts

    @classmethod
    def from_gguf(cls, file: Any, n_experts: int, top_k: int) -> ExpertLayout:
        """From an open `weights.gguf_file.GGUFFile` (tensor headers only; nothing is read)."""
        layers = []
        i = 0
        while f"blk.{i}.ffn_gate_exps.weight" in file:
            kinds = []
            for kind in KINDS:
                name = f"blk.{i}.{TENSOR_OF_KIND[kind]}.weight"
                if name not in file:
                    raise ModelFormatError(f"{file.path}: missing tensor {name}")
                info = file.info(name)
                shape, qtype, n_bytes = info.shape, info.qtype, int(info.nbytes)
                if shape[0] != n_experts or n_bytes % n_experts:
                    raise ModelFormatError(
                        f"{file.path}: tensor {name} of shape {list(shape)} does not stack "
                        f"{n_experts} experts"
                    )
                kinds.append(
                    ExpertTensor(name, qtype, shape[1:], int(info.offset), n_bytes // n_experts)
                )
            layers.append(tuple(kinds))
            i += 1
        if not layers:
            raise ModelFormatError(f"{file.path}: no stacked expert tensors (not an MoE model)")
        return cls(Path(file.path), n_experts, top_k, tuple(layers))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Placement:
    """Slots per layer on the device and in the host tier, and the pinned staging bytes."""

    device_slots: tuple[int, ...]
    host_slots: tuple[int, ...]
    expert_bytes: tuple[int, ...]  # per layer
    n_experts: int
    top_k: int
    staging_bytes: int = 0

    @property
    def device_bytes(self) -> int:
        return sum(s * b for s, b in zip(self.device_slots, self.expert_bytes))

    @property
    def host_bytes(self) -> int:
        return sum(s * b for s, b in zip(self.host_slots, self.expert_bytes)) + self.staging_bytes

    @property
    def total_expert_bytes(self) -> int:
        return sum(b * self.n_experts for b in self.expert_bytes)

    @property
    def fully_resident(self) -> bool:
        return all(s == self.n_experts for s in self.device_slots)


def _fill_slots(
    budget: int, expert_bytes: Sequence[int], caps: Sequence[int], floor: int
) -> list[int]:
    """Equal slots per layer (within caps), then one more at a time to the first layers."""
    live = [i for i, c in enumerate(caps) if c > 0]
    per = sum(expert_bytes[i] for i in live)
    even = budget // per if per else 0
    slots = [min(max(even, floor), c) if c else 0 for c in caps]
    left = budget - sum(s * b for s, b in zip(slots, expert_bytes))
    grown = True
    while grown:
        grown = False
        for i in live:
            if slots[i] < caps[i] and expert_bytes[i] <= left:
                slots[i] += 1
                left -= expert_bytes[i]
                grown = True
    return slots


def plan_placement(
    layout: ExpertLayout, budgets: ExpertBudgets, staging_experts: int = 0
) -> Placement:
    """The placement `budgets` give for `layout`. `staging_experts`: pinned staging buffers the
    disk reads need (on CUDA: one per I/O thread), paid from the host budget when it covers them.

    Raises CapacityError when the device budget holds fewer than `top_k` experts in some layer
    (the message names the smallest budget that can run)."""
    eb = [layout.expert_bytes(i) for i in range(layout.n_layers)]
    n, k = layout.n_experts, layout.top_k
    if not budgets.streaming:
        return Placement(tuple([n] * len(eb)), tuple([0] * len(eb)), tuple(eb), n, k)
    minimum = k * sum(eb)
    if budgets.device_bytes < minimum:
        raise CapacityError(
            f"--gpu-expert-cache-gib {budgets.gpu_expert_cache_gib:g} holds fewer than "
            f"{k} experts of every layer; the smallest that can run is "
            f"{math.ceil(minimum / GIB * 1e4) / 1e4:g} GiB"
        )
    device = _fill_slots(budgets.device_bytes, eb, [n] * len(eb), k)
    staging = staging_experts * max(eb)
    if staging > budgets.host_bytes:
        staging = 0  # too small to pin staging buffers: the reads go through pageable memory
    host_caps = [0 if d == n else n for d in device]
    host = _fill_slots(budgets.host_bytes - staging, eb, host_caps, 0)
    return Placement(tuple(device), tuple(host), tuple(eb), n, k, staging)


def traffic_per_token(
    placement: Placement, device_hit_rate: float | None = None, host_hit_rate: float | None = None
) -> dict[str, float]:
    """Expected expert bytes moved per decoded token (batch 1): `top_k` experts of every layer,
    the misses of the device tier copied from the host tier, the host tier's misses read from
    disk. A hit rate of None assumes uniform routing (a tier holding s of E experts hits s/E)."""
    n, k = placement.n_experts, placement.top_k
    needed = host_to_device = disk = 0.0
    for d, h, b in zip(placement.device_slots, placement.host_slots, placement.expert_bytes):
        hd = min(d / n, 1.0) if device_hit_rate is None else device_hit_rate
        hh = min(max(h - d, 0) / max(n - d, 1), 1.0) if host_hit_rate is None else host_hit_rate
        if d == n:
            hd = 1.0
        miss = k * b * (1.0 - hd)
        needed += k * b
        host_to_device += miss
        disk += miss * (1.0 - hh)
    return {
        "expert_bytes_read": needed,
        "bytes_to_device": host_to_device,
        "bytes_from_disk": disk,
    }


def placement_summary(
    layout: ExpertLayout,
    placement: Placement,
    device_hit_rate: float | None = None,
    host_hit_rate: float | None = None,
) -> dict[str, Any]:
    """Plain JSON-able data: slots, bytes per tier, bytes moved per token."""
    return {
        "n_layers": layout.n_layers,
        "n_experts": layout.n_experts,
        "top_k": layout.top_k,
        "expert_bytes": list(placement.expert_bytes),
        "device_slots": list(placement.device_slots),
        "host_slots": list(placement.host_slots),
        "device_bytes": placement.device_bytes,
        "host_bytes": placement.host_bytes,
        "staging_bytes": placement.staging_bytes,
        "total_expert_bytes": placement.total_expert_bytes,
        "device_hit_rate": device_hit_rate,
        "host_hit_rate": host_hit_rate,
        "per_token": traffic_per_token(placement, device_hit_rate, host_hit_rate),
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _slots(slots: Sequence[int]) -> str:
    lo, hi = min(slots), max(slots)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def format_placement(summary: dict[str, Any]) -> str:
    """`placement_summary`'s result as text lines for `moestream info --budgets`."""
    s = summary
    n, total = s["n_experts"], s["total_expert_bytes"]
    dev, host = s["device_slots"], s["host_slots"]
    in_dev = sum(dev) / (n * len(dev))
    in_host = sum(host) / (n * len(host))
    disk_only = sum(n - max(d, h) for d, h in zip(dev, host)) / (n * len(dev))  # inclusive host
    if s["device_hit_rate"] is None:
        rate = "uniform routing (a tier of s slots hits s/E)"
    else:
        rate = f"device hit rate {s['device_hit_rate']:g}"
        if s["host_hit_rate"] is not None:
            rate += f", host hit rate {s['host_hit_rate']:g}"
    t = s["per_token"]
    graphs = []
    if "graph_batch" in s:
        b = s["graph_batch"]
        graphs = [
            f"{'decode graphs':16} "
            + (
                "whole CUDA graphs (every expert in device slots)"
                if b is None
                else f"chains of CUDA graphs at up to {b} requests a step (the routed "
                "experts fit the slots), eager beyond"
            )
        ]
    if s.get("paged_slots") is not None:
        graphs.append(
            f"{'on CUDA':16} paged (the default there): every expert in pinned host memory, "
            f"{s['paged_slots']} device slots a layer paged by the GPU, whole CUDA graphs, "
            f"{_mib(s['paged_bytes_per_token'])} copied to the device per token at {rate}; "
            "the lines above are the streamed placement (--expert-paging off)"
        )
    elif s.get("paged_refused"):
        graphs.append(f"{'on CUDA':16} streamed as above; not paged: {s['paged_refused']}")
    return "\n".join(
        [
            f"{'expert weights':16} {_mib(total)} ({s['n_layers']} layers x {n} experts)",
            f"{'device slots':16} {_slots(dev)} of {n} per layer, {_mib(s['device_bytes'])} "
            f"({in_dev:.0%} of the experts)",
            f"{'host tier':16} {_slots(host)} per layer, {_mib(s['host_bytes'])} "
            f"({in_host:.0%} of the experts; staging {_mib(s['staging_bytes'])})",
            f"{'only on disk':16} {disk_only:.0%} of the experts",
            f"{'per token':16} {s['top_k']} experts x {s['n_layers']} layers = "
            f"{_mib(t['expert_bytes_read'])} of expert weights read",
            f"{'moved per token':16} {_mib(t['bytes_to_device'])} copied to the device, "
            f"{_mib(t['bytes_from_disk'])} read from disk, at {rate}",
            *graphs,
        ]
    )
