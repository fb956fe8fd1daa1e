"""Launch shapes tuned once per device and cached (`moestream tune`, `kernels.tuner`), which the
decode kernels' config functions return in place of their hand-made defaults: the cache, its
shape keys and the lookup the kernels make.

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
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from gguf import GGMLQuantizationType

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
