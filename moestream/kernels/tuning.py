"""Launch shapes tuned once per device and cached (`moestream tune`), which the decode kernels'
config functions return in place of their hand-made defaults.

Only knobs that leave every output element's arithmetic as it is are tuned, so a cached shape
cannot change a bit of any result (greedy text stays the same run to run, with or without the
cache, at any batch size):
- the dense "once" GEMV (`mmvq.mmvq_config`, `mmvq.mmvq_pair`): rows per program (`block_n`)
  and warps. The K split and groups per step, which fix a row's sums, stay the default's.
- the MoE's "once" gate/up kernel (`moe_mmvq.DEFAULT_CONFIG`): `up_block_n` and `up_warps`
  (each row reduced by `mmvq.tree_sum`; tested to give the same bits at any rows and warps).
  The down kernel's rows and warps stay: its per-step sums are `tl.sum`s whose order follows
  the register layout, which those knobs change (`moe_mmvq._row_sums`); its expert split and
  groups per step change the sums too.
On top of that the tuner keeps a candidate only if its output is bit for bit the default's on
the same random inputs (`tune_shape`).

The cache is JSON at $MOESTREAM_CACHE_DIR/launch-shapes.json (default ~/.cache/moestream/),
read once per process at the first lookup; MOESTREAM_TUNE_CACHE=off ignores it:
  {"format": 1, "devices": {DEVICE: {KERNEL: {SHAPE: {"config": {knob: value},
   "base": {the default config it was tuned against}, "us": 5.1, "default_us": 5.6}}}}}
DEVICE is the GPU's name, compute capability and Triton version (`device_key`); KERNEL "mmvq",
"mmvq_pair" or "moe_mmvq"; SHAPE the `key` of a `DenseShape`, `PairShape` or `MoeShape`. An
entry applies only while its "base" is still the default for that shape; entries that are not
valid are ignored, and a file that cannot be read or parsed gives one warning.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from tqdm import tqdm

from moestream.errors import UnsupportedError
from moestream.weights.qtensor import QTensor

CACHE_FILE = "launch-shapes.json"
FORMAT = 1
_WARPS = (1, 2, 4, 8, 16)
# The knobs each kernel takes from the cache, with their valid values.
KNOBS: dict[str, dict[str, tuple[int, ...]]] = {
    "mmvq": {"block_n": (1, 2, 4, 8, 16, 32), "num_warps": _WARPS},
    "mmvq_pair": {"block_n": (1, 2, 4, 8, 16, 32), "num_warps": _WARPS},
    "moe_mmvq": {"up_block_n": (1, 2, 4, 8, 16, 32), "up_warps": _WARPS},
}


@functools.cache
def weight_label(qtype: GGMLQuantizationType, padded: bool) -> str:
    """The type's name ("Q4_K"), with "/padded" for the 224-byte blocks of `QTensor.aligned`."""
    return qtype.name + ("/padded" if padded else "")


def parse_label(label: str) -> tuple[GGMLQuantizationType, bool]:
    name, _, layout = label.partition("/")
    return GGMLQuantizationType[name], layout == "padded"


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class DenseShape(NamedTuple):
    """One `mmvq` launch ("once" variant): the weight's type label, N, K, M_BLOCK."""

    weight: str
    n: int
    k: int
    m_block: int
    kernel = "mmvq"

    @property
    def key(self) -> str:
        return f"{self.weight} n={self.n} k={self.k} m={self.m_block}"


class PairShape(NamedTuple):
    """One `mmvq_pair` launch: two weights of N and N2 rows over the same K, M_BLOCK."""

    weight: str
    weight2: str
    n: int
    n2: int
    k: int
    m_block: int
    kernel = "mmvq_pair"

    @property
    def key(self) -> str:
        return f"{self.weight}+{self.weight2} n={self.n}+{self.n2} k={self.k} m={self.m_block}"


class MoeShape(NamedTuple):
    """One "mmvq" MoE step: gate, up, down type labels, H, F, experts per token, tokens (rounded
    up to a power of two)."""

    gate: str
    up: str
    down: str
    h: int
    f: int
    top_k: int
    tokens: int
    kernel = "moe_mmvq"

    @property
    def key(self) -> str:
        return (
            f"{self.gate}+{self.up}+{self.down} h={self.h} f={self.f} topk={self.top_k} "
            f"t={self.tokens}"
        )


Shape = DenseShape | PairShape | MoeShape


# ---- the cache ---------------------------------------------------------------------------------


class _State:
    """The process's view of the cache file, read at the first lookup."""

    def __init__(self) -> None:
        self.devices: dict[str, Any] | None = None  # the file's "devices" ({}: none)
        self.device_keys: dict[torch.device, str] = {}
        self.memo: dict[tuple, Any] = {}  # (device, shape, default) -> config
        self.trace: set[Shape] | None = None  # shapes looked up inside `tracing()`


_state = _State()


def cache_path(directory: str | Path | None = None) -> Path:
    """`directory`/launch-shapes.json; by default in $MOESTREAM_CACHE_DIR or ~/.cache/moestream."""
    if not directory:
        directory = os.environ.get("MOESTREAM_CACHE_DIR") or Path.home() / ".cache" / "moestream"
    return Path(directory).expanduser() / CACHE_FILE


def cache_enabled() -> bool:
    """False where MOESTREAM_TUNE_CACHE is off (or 0, false, no): the defaults everywhere."""
    return os.environ.get("MOESTREAM_TUNE_CACHE", "on").lower() not in ("off", "0", "false", "no")


def reset() -> None:
    """Forget the file read and every lookup made: the next lookup reads it again."""
    _state.__init__()


def device_key(device: torch.device) -> str:
    """The cache's key for `device`: GPU name and compute capability (the device type elsewhere,
    i.e. the Triton interpreter) and the Triton version, e.g. "NVIDIA H200 sm_90 triton 3.4.0"."""
    import triton

    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"
    else:
        name = device.type
    return f"{name} triton {triton.__version__}"


def read_cache(path: Path) -> dict[str, Any]:
    """The "devices" of the cache file at `path` ({} when there is none); a file that cannot be
    read or is not a cache of this format gives one warning and {}."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        _warn(f"launch-shape cache {path} cannot be read ({e})")
        return {}
    if not (
        isinstance(data, dict)
        and data.get("format") == FORMAT
        and isinstance(data.get("devices"), dict)
    ):
        _warn(f"launch-shape cache {path} is not a format-{FORMAT} cache")
        return {}
    return data["devices"]


def _warn(message: str) -> None:
    warnings.warn(f"{message}; using the default launch shapes", RuntimeWarning, stacklevel=3)


def config_dict(cfg: Any) -> dict[str, Any]:
    """A launch config (`MmvqConfig` or `MoeMmvqConfig`) as a JSON-able dict."""
    return dict(cfg._asdict()) if hasattr(cfg, "_asdict") else dataclasses.asdict(cfg)


def with_knobs(cfg: Any, knobs: dict[str, int]) -> Any:
    return cfg._replace(**knobs) if hasattr(cfg, "_replace") else dataclasses.replace(cfg, **knobs)


def entry_knobs(kernel: str, entry: Any, default: Any) -> dict[str, int] | None:
    """The knobs of a cache entry for `kernel`, or None unless it has every knob of KNOBS with a
    valid value and nothing else, and was tuned against `default`."""
    allowed = KNOBS[kernel]
    if not isinstance(entry, dict) or entry.get("base") != config_dict(default):
        return None
    knobs = entry.get("config")
    if not isinstance(knobs, dict) or set(knobs) != set(allowed):
        return None
    if any(type(v) is not int or v not in allowed[name] for name, v in knobs.items()):
        return None
    return knobs


def tuned(device: torch.device, shape: Shape, default: Any) -> Any:
    """`default` with the knobs cached for `shape` on `device`, else `default` itself. After the
    first call per (device, shape, default) one dict lookup."""
    state = _state
    if state.trace is not None:
        state.trace.add(shape)
    key = (device, shape, default)
    cfg = state.memo.get(key)
    if cfg is None:
        cfg = state.memo[key] = _resolve(device, shape, default)
    return cfg


def _resolve(device: torch.device, shape: Shape, default: Any) -> Any:
    state = _state
    if state.devices is None:
        state.devices = read_cache(cache_path()) if cache_enabled() else {}
    if not state.devices:
        return default
    if device not in state.device_keys:
        state.device_keys[device] = device_key(device)
    kernels = state.devices.get(state.device_keys[device])
    shapes = kernels.get(shape.kernel) if isinstance(kernels, dict) else None
    entry = shapes.get(shape.key) if isinstance(shapes, dict) else None
    knobs = entry_knobs(shape.kernel, entry, default)
    return with_knobs(default, knobs) if knobs else default


@contextmanager
def tracing() -> Iterator[set[Shape]]:
    """The shapes of every launch that consults the cache while the block runs (how `moestream
    tune` finds a model's decode launches: one forward of a token)."""
    _state.trace = seen = set()
    try:
        yield seen
    finally:
        _state.trace = None


def write_cache(path: Path, device: str, entries: dict[str, dict[str, dict | None]]) -> None:
    """Merge `entries` (kernel -> shape key -> entry, None to drop one) into the cache file under
    device key `device`, keeping every other entry; written to a temporary file and renamed."""
    devices = read_cache(path)
    mine = devices.get(device) if isinstance(devices.get(device), dict) else {}
    for kernel, items in entries.items():
        shapes = mine.get(kernel) if isinstance(mine.get(kernel), dict) else {}
        for key, entry in items.items():
            if entry is None:
                shapes.pop(key, None)
            else:
                shapes[key] = entry
        mine[kernel] = shapes
    devices[device] = mine
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "devices": devices}, indent=1) + "\n")
    os.replace(tmp, path)


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
    from moestream.kernels.mmvq import default_mmvq_config, default_pair_config
    from moestream.kernels.moe_mmvq import DEFAULT_CONFIG

    if isinstance(shape, MoeShape):
        return DEFAULT_CONFIG
    sms = num_sms(device)
    if isinstance(shape, PairShape):
        return default_pair_config(shape.n + shape.n2, shape.k, sms, shape.m_block)
    padded = parse_label(shape.weight)[1]
    return default_mmvq_config(shape.n, shape.k, sms, shape.m_block, "once", padded)


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
