"""`moestream tune`: for each decode launch shape of a model, time the default launch shape and
the candidates `candidates` offers (rows per program and warps, which leave every output
element's arithmetic as it is), keep a candidate only if its output is bit for bit the
default's on the same random operands, and cache the fastest (`kernels.tuning`).

Each candidate is a Triton compile of its own (~1-3 s): `compile_ahead` compiles them in
worker processes first, which fill Triton's on-disk cache, so that the timing pass in this
process loads binaries instead of compiling one at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import multiprocessing
import statistics
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol

import torch
from gguf import GGML_QUANT_SIZES
from tqdm import tqdm

from moestream.errors import UnsupportedError
from moestream.kernels.tuning import (
    KNOBS,
    DenseShape,
    MoeShape,
    PairShape,
    Shape,
    config_dict,
    next_power_of_2,
    parse_label,
)
from moestream.weights.qtensor import QTensor

# ---- candidates --------------------------------------------------------------------------------

ROWS = (2, 4, 8, 16)  # dense rows per program tried
MOE_ROWS = (2, 4, 8, 16, 32)  # gate/up rows per program tried
WARPS = (1, 2, 4, 8)
# Float32 partial sums a lane holds in a candidate's [runs, 2, M, rows] tile(s), at most: the
# defaults' largest is 64 (8 rows, 16 groups a step, M = 8, 4 warps); beyond, spills.
TILE_BUDGET = 64
MIN_GAIN = 0.02  # a candidate replaces the default only when at least this much faster


def _lane_sums(runs: int, m_block: int, rows: int, warps: int) -> float:
    return runs * 2 * m_block * rows / (32 * warps)


def candidates(shape: Shape, default: Any) -> list[Any]:
    """Launch shapes to try against `default` for `shape`, all computing every element as it
    does: other rows per program and warps (each warp count as `mmvq_once.capped_warps` would
    launch it, none twice), no more partial sums per lane than TILE_BUDGET or the default, and
    from M = 2 no fewer warps than the default (one warp spills there in the sm_90 builds)."""
    from moestream.kernels.mmvq_once import capped_warps, runs_per_group

    if isinstance(shape, MoeShape):
        if not default.up_once:
            return []
        sub = runs_per_group(parse_label(shape.gate)[0], parse_label(shape.up)[0])
        groups = min(default.up_groups, next_power_of_2(shape.h // 256))
        base = (default.up_block_n, capped_warps(default.up_warps, sub, groups))
        budget = max(TILE_BUDGET, 2 * _lane_sums(sub * groups, 1, *base))
        out = []
        for rows in MOE_ROWS:
            for warps in WARPS:
                if (
                    capped_warps(warps, sub, groups) == warps
                    and (rows, warps) != base
                    and 2 * _lane_sums(sub * groups, 1, rows, warps) <= budget
                ):
                    out.append(dataclasses.replace(default, up_block_n=rows, up_warps=warps))
        return out
    labels = (shape.weight,) if isinstance(shape, DenseShape) else (shape.weight, shape.weight2)
    sub = runs_per_group(*(parse_label(label)[0] for label in labels))
    base = (default.block_n, capped_warps(default.num_warps, sub, default.groups))
    runs = sub * default.groups
    budget = max(TILE_BUDGET, _lane_sums(runs, shape.m_block, *base))
    out = []
    for rows in ROWS:
        for warps in WARPS:
            if (
                capped_warps(warps, sub, default.groups) == warps
                and (rows, warps) != base
                and (shape.m_block == 1 or warps >= base[1])
                and _lane_sums(runs, shape.m_block, rows, warps) <= budget
            ):
                out.append(default._replace(block_n=rows, num_warps=warps))
    return out


def default_config(shape: Shape, device: torch.device) -> Any:
    """The launch shape the kernels take for `shape` without the cache."""
    from moestream.kernels._triton_dequant import num_sms
    from moestream.kernels.mmvq import default_pair_config, mmvq_config
    from moestream.kernels.moe_mmvq import DEFAULT_CONFIG

    if isinstance(shape, MoeShape):
        return DEFAULT_CONFIG
    sms = num_sms(device)
    if isinstance(shape, PairShape):
        return default_pair_config(shape.n + shape.n2, shape.k, sms, shape.m_block)
    padded = parse_label(shape.weight)[1]
    return mmvq_config(shape.n, shape.k, sms, shape.m_block, "once", padded)  # no qtype: untuned


# ---- workloads and timing ----------------------------------------------------------------------

# Byte offsets of a block's float16 scales (kept finite and small) and E8M0 exponents (110..140).
_F16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,), "Q4_0": (0,)}
_F16_FIELDS.update({"IQ4_NL": (0,), "IQ4_XS": (0,)})
_E8M0_FIELDS = {"MXFP4": (0,)}


def random_weight(label: str, shape: tuple[int, ...], device: torch.device, seed: int) -> QTensor:
    """Random blocks of the type `label` names (every bit pattern of the quants, finite scales),
    logical `shape`, made on `device`."""
    qtype, padded = parse_label(label)
    block, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = math.prod(shape) // block
    g = torch.Generator(device=device).manual_seed(seed)
    data = torch.randint(0, 256, (blocks, nbytes), generator=g, device=device, dtype=torch.uint8)
    for off in _F16_FIELDS.get(qtype.name, ()):
        scale = (torch.rand(blocks, generator=g, device=device) + 0.5) * 2**-10
        data[:, off : off + 2] = scale.half().view(torch.uint8).view(blocks, 2)
    for off in _E8M0_FIELDS.get(qtype.name, ()):
        data[:, off] = torch.randint(110, 141, (blocks,), generator=g, device=device)
    w = QTensor(data.view(*shape[:-1], -1), qtype, shape)
    return w.aligned() if padded else w


class Workload(NamedTuple):
    """Random operands of one shape: `launch(config, out)` runs the kernel(s) into out (float32
    of `out_shape`)."""

    launch: Callable[[Any, torch.Tensor], object]
    out_shape: tuple[int, int]


def workload(shape: Shape, device: torch.device, seed: int = 0) -> Workload:
    from moestream.kernels.mmvq import mmvq, mmvq_pair, quantize_q8
    from moestream.kernels.moe_mmvq import fused_moe_mmvq, mmvq_counters

    g = torch.Generator().manual_seed(seed)
    if isinstance(shape, MoeShape):
        t, h, f, k = shape.tokens, shape.h, shape.f, shape.top_k
        e = t * k  # every assignment its own expert, as with many experts
        gate = random_weight(shape.gate, (e, f, h), device, seed + 1)
        up = random_weight(shape.up, (e, f, h), device, seed + 2)
        down = random_weight(shape.down, (e, h, f), device, seed + 3)
        x = torch.randn(t, h, generator=g).to(device)  # [T, H]
        xa = quantize_q8(x)
        ids = torch.randperm(e, generator=g).view(t, k).to(device, torch.int32)  # [T, k]
        weights = torch.rand(t, k, generator=g).softmax(-1).to(device)
        slot = torch.arange(e, dtype=torch.int32, device=device)
        counters = mmvq_counters(e, f, device, h, k)

        def moe(cfg: Any, out: torch.Tensor) -> object:
            args = (x, xa, ids, weights, gate, up, down, slot, None, out, cfg, counters)
            return fused_moe_mmvq(*args)

        return Workload(moe, (t, h))
    a = quantize_q8(torch.randn(shape.m_block, shape.k, generator=g).to(device))  # [M, K]
    w = random_weight(shape.weight, (shape.n, shape.k), device, seed + 1)
    if isinstance(shape, DenseShape):
        return Workload(lambda cfg, out: mmvq(a, w, out=out, config=cfg), (shape.m_block, shape.n))
    w2 = random_weight(shape.weight2, (shape.n2, shape.k), device, seed + 2)
    return Workload(
        lambda cfg, out: mmvq_pair(a, w, w2, out=out, config=cfg),
        (shape.m_block, shape.n + shape.n2),
    )


class Timer(Protocol):
    def __call__(self, run: Callable[[], object], shape: Shape, config: Any) -> float:
        """Microseconds that `run()` (`config` at `shape`) takes on the device."""
        ...


def cuda_timer(device: torch.device, repeats: int = 20, warmup: int = 3) -> Timer:
    """A Timer: the median over `repeats` runs (after `warmup`) of CUDA event pairs around the
    run, the L2 cache overwritten before each (a decode step's weights come from DRAM: each
    layer reads its own)."""
    props = torch.cuda.get_device_properties(device)
    flush = torch.empty(max(512 << 20, 8 * props.L2_cache_size), dtype=torch.uint8, device=device)

    def time(run: Callable[[], object], shape: Shape, config: Any) -> float:
        for _ in range(warmup):
            run()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeats)
        ]
        for start, end in events:
            flush.zero_()  # also keeps the GPU busy while the host launches `run`
            start.record()
            run()
            end.record()
        torch.cuda.synchronize(device)
        return 1000.0 * statistics.median(s.elapsed_time(e) for s, e in events)

    return time


def make_timer(device: torch.device, repeats: int) -> Timer:
    """`cuda_timer`, or UnsupportedError where `device` is not a CUDA GPU (tests replace this)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise UnsupportedError(f"tune needs a CUDA GPU (got device {device})")
    return cuda_timer(device, repeats)


# ---- the tuner ---------------------------------------------------------------------------------


class TuneResult(NamedTuple):
    shape: Shape
    default: Any
    default_us: float
    best: Any  # the default unless a candidate was MIN_GAIN faster
    best_us: float
    tried: int  # candidates with the default's bits, timed
    rejected: int  # candidates whose output bits differ from the default's


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def tune_shape(
    shape: Shape,
    device: torch.device,
    timer: Timer,
    candidates_of: Callable[[Shape, Any], list[Any]] = candidates,
    seed: int = 0,
) -> TuneResult:
    """Time the default launch shape and each candidate at `shape` on random operands; a
    candidate whose output differs from the default's in any bit is rejected untimed."""
    load = workload(shape, device, seed)
    default = default_config(shape, device)

    def output(cfg: Any) -> torch.Tensor:
        out = torch.full(load.out_shape, float("nan"), device=device)  # unwritten: not equal
        load.launch(cfg, out)
        return out

    ref = output(default)
    buf = torch.empty(load.out_shape, device=device)
    default_us = timer(functools.partial(load.launch, default, buf), shape, default)
    best, best_us, tried, rejected = default, default_us, 0, 0
    for cfg in candidates_of(shape, default):
        if not same_bits(output(cfg), ref):
            rejected += 1
            continue
        tried += 1
        us = timer(functools.partial(load.launch, cfg, buf), shape, cfg)
        if us < best_us:
            best, best_us = cfg, us
    if best_us > default_us * (1 - MIN_GAIN):
        best, best_us = default, default_us
    return TuneResult(shape, default, default_us, best, best_us, tried, rejected)


def tune_shapes(
    shapes: Iterable[Shape], device: torch.device, timer: Timer, progress: bool = True
) -> list[TuneResult]:
    shapes = list(shapes)
    bar = tqdm(shapes, desc="tune", unit="shape", disable=not progress)
    return [tune_shape(s, device, timer) for s in bar]


COMPILE_CHUNK = 4  # launch shapes a worker compiles per task (one shape's operands made once)


def compile_tasks(shapes: Iterable[Shape], device: torch.device) -> list[tuple[Shape, list]]:
    """(shape, launch configs) tasks covering the default and every candidate of each shape,
    at most COMPILE_CHUNK configs a task."""
    tasks = []
    for shape in shapes:
        default = default_config(shape, device)
        configs = [default, *candidates(shape, default)]
        for i in range(0, len(configs), COMPILE_CHUNK):
            tasks.append((shape, configs[i : i + COMPILE_CHUNK]))
    return tasks


def _compile_task(device: str, task: tuple[Shape, list]) -> int:
    """In a worker process: launch each config of the task once on random operands, so that
    Triton's on-disk cache holds its binary. Returns the configs launched."""
    shape, configs = task
    dev = torch.device(device)
    load = workload(shape, dev)
    out = torch.empty(load.out_shape, device=dev)
    for cfg in configs:
        load.launch(cfg, out)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return len(configs)


def compile_ahead(
    shapes: Iterable[Shape], device: torch.device, jobs: int, progress: bool = True
) -> int:
    """Compile every launch config `tune_shapes` will run, in `jobs` worker processes (spawned:
    each makes its own CUDA context), before the timing pass: the binaries land in Triton's
    on-disk cache, where this process then finds them. Returns the configs compiled (0 with
    jobs < 2: `tune_shapes` compiles as it goes)."""
    tasks = compile_tasks(shapes, device)
    if jobs < 2 or not tasks:
        return 0
    work = functools.partial(_compile_task, str(device))
    total = sum(len(configs) for _, configs in tasks)
    bar = tqdm(total=total, desc="compile", unit="launch", disable=not progress)
    with multiprocessing.get_context("spawn").Pool(min(jobs, len(tasks))) as pool:
        for n in pool.imap_unordered(work, tasks):
            bar.update(n)
    bar.close()
    return total


def widen(shapes: Iterable[Shape], batch_sizes: Iterable[int]) -> list[Shape]:
    """The shapes at each batch size (rounded up to a power of two) that takes the same kernel
    (the dense types' `mmvq` row limit; the MoE's "mmvq" path below the grouped one), sorted."""
    from moestream.kernels.moe import GROUPED_MIN_ASSIGNMENTS
    from moestream.kernels.ops import _mmvq_most_rows

    out: set[Shape] = set()
    for s in shapes:
        for b in map(next_power_of_2, batch_sizes):
            if isinstance(s, MoeShape):
                if b * s.top_k < GROUPED_MIN_ASSIGNMENTS:
                    out.add(s._replace(tokens=b))
                continue
            labels = (s.weight,) if isinstance(s, DenseShape) else (s.weight, s.weight2)
            if all(b <= _mmvq_most_rows(parse_label(label)[0]) for label in labels):
                out.add(s._replace(m_block=b))
    return sorted(out, key=lambda s: (s.kernel, s.key))


def cache_entries(results: Iterable[TuneResult]) -> dict[str, dict[str, dict | None]]:
    """`write_cache`'s entries: the tuned knobs where a candidate won, None (drop) elsewhere."""
    entries: dict[str, dict[str, dict | None]] = {}
    for r in results:
        entry = None
        if r.best != r.default:
            entry = {
                "config": {name: getattr(r.best, name) for name in KNOBS[r.shape.kernel]},
                "base": config_dict(r.default),
                "us": round(r.best_us, 2),
                "default_us": round(r.default_us, 2),
            }
        entries.setdefault(r.shape.kernel, {})[r.shape.key] = entry
    return entries


def format_results(results: Iterable[TuneResult]) -> str:
    """A table: kernel, shape, default and best microseconds, the knobs chosen, candidates
    rejected for changing bits."""
    rows = [("kernel", "shape", "default us", "best us", "chosen", "rejected (bits)")]
    for r in results:
        chosen = "default"
        if r.best != r.default:
            chosen = " ".join(f"{name}={getattr(r.best, name)}" for name in KNOBS[r.shape.kernel])
        tested = r.tried + r.rejected
        rows.append((r.shape.kernel, r.shape.key, f"{r.default_us:.1f}", f"{r.best_us:.1f}",
                     chosen, f"{r.rejected} of {tested}"))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            c.rjust(w) if i in (2, 3) else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
