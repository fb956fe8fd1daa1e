"""Native CPU code: the decode MoE's expert arithmetic as the GPU computes it (`experts.c`).

The C source is compiled on first use with the system's C compiler (`$CC`, else `cc`) into the
cache directory ($MOESTREAM_CACHE_DIR or ~/.cache/moestream, `native/`, named by a hash of the
source, flags and CPU) and loaded with ctypes; calls release the GIL, so threads may run them
side by side. Flags keep every float operation rounding as written: `-ffp-contract=off`, no
`-ffast-math` (vector instructions compute each lane's operation as the scalar one would).
Where no compiler is found `NativeUnavailable` says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

SOURCE = Path(__file__).with_name("experts.c")
FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
# On x86-64 CPUs with AVX2 and FMA the build targets them (`_arch_flags`): the hardware fma is
# several times faster than libm's fmaf and rounds the same. Not -march=native: on the
# development machine (znver3) its tuning made the gate/up 30% slower than the generic one
# (`python bench/native_experts.py`).
X86_64_V3 = {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "xsave"}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: NativeUnavailable | None = None  # a failed build is not tried again in this process


class NativeUnavailable(RuntimeError):
    """The native code cannot be built here (no C compiler, or it failed)."""


def _cache_dir() -> Path:
    base = os.environ.get("MOESTREAM_CACHE_DIR") or Path.home() / ".cache" / "moestream"
    return Path(base) / "native"


def library() -> ctypes.CDLL:
    """The compiled `experts.c` (built once per source, flags and compiler)."""
    global _lib, _error
    with _lock:
        if _error is not None:
            raise _error
        if _lib is None:
            try:
                _lib = _build()
            except NativeUnavailable as e:
                _error = e
                raise
        return _lib


def _cpu_features() -> str:
    """This CPU's model and feature flags (part of the build's key: its target and dispatch
    follow them)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def _arch_flags(features: str) -> list[str]:
    """-march=x86-64-v3 where this CPU (`_cpu_features`) has its features, else nothing (the
    compiler's default: on aarch64 fma is in the base instruction set)."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = set()
    for line in features.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return ["-march=x86-64-v3"] if flags >= X86_64_V3 else []


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise NativeUnavailable(f"no C compiler ({cc!r} not found; set CC)")
    src = SOURCE.read_bytes()
    errors = []
    features = _cpu_features()
    arch = _arch_flags(features)
    # threads in moe_host_rows where the compiler has OpenMP; the target where it knows it;
    # POSIX threads for the host poller
    omp = ["-fopenmp", "-pthread"]
    tries = [[*arch, *omp], omp, [*arch, "-pthread"], ["-pthread"]] if arch else [omp, ["-pthread"]]
    for extra in tries:
        flags = [*FLAGS, *extra]
        key = hashlib.sha256(src + " ".join([cc, *flags, features]).encode()).hexdigest()
        out = _cache_dir() / f"experts-{key[:16]}.so"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
                tmp_out = Path(tmp) / out.name
                run = subprocess.run(
                    [cc, *flags, "-o", str(tmp_out), str(SOURCE), "-lm"],
                    capture_output=True, text=True,
                )  # fmt: skip
                if run.returncode != 0:
                    tail = " / ".join(run.stderr.strip().splitlines()[-8:])
                    errors.append(f"{cc} {' '.join(extra)}: {tail[-1500:]}")
                    continue
                os.replace(tmp_out, out)  # atomic: another process may build the same file
        try:
            lib = ctypes.CDLL(str(out))
        except OSError as e:
            errors.append(f"loading {out.name}: {e}")
            continue
        break
    else:
        raise NativeUnavailable(f"cannot build {SOURCE.name}: " + " | ".join(errors))
    p = ctypes.c_void_p
    lib.gate_up_q4_k.argtypes = [p, p, ctypes.c_int64, *[ctypes.c_int] * 4, *[p] * 7]
    lib.gate_up_q4_k.restype = ctypes.c_int
    lib.down_rows.argtypes = [p, ctypes.c_int64, *[ctypes.c_int] * 5, p, p, p, ctypes.c_float, p]
    lib.down_rows.restype = ctypes.c_int
    ints = [ctypes.c_int] * 4
    lib.moe_host_rows.argtypes = [ctypes.c_int, *[p] * 6, ctypes.c_int64, p, *ints, *[p] * 7]
    lib.moe_host_rows.argtypes += [ctypes.c_int]
    lib.moe_host_rows.restype = ctypes.c_int
    lib.native_force_scalar.argtypes = [ctypes.c_int]
    lib.native_force_scalar.restype = None
    lib.silu_rn_n.argtypes = [p, p, ctypes.c_int64]
    lib.silu_rn_n.restype = None
    lib.host_layer.argtypes = [p]
    lib.host_layer.restype = None
    lib.host_poller_start.argtypes = [p]
    lib.host_poller_start.restype = ctypes.c_int
    lib.host_poller_stop.argtypes = [p]
    lib.host_poller_stop.restype = None
    lib.host_poller_size.argtypes = []
    lib.host_poller_size.restype = ctypes.c_size_t
    if lib.host_poller_size() != ctypes.sizeof(HostPoller):
        raise NativeUnavailable("experts.c's host_poller and HostPoller differ in layout")
    return lib


class HostLayerArgs(ctypes.Structure):
    """`experts.c`'s host_layer_args: one MoE layer's host work for one launch shape (the
    layer's expert tables, the launch's buffers, counters)."""

    _fields_ = [
        ("marked", ctypes.c_void_p),
        ("gate", ctypes.c_void_p),
        ("up", ctypes.c_void_p),
        ("down", ctypes.c_void_p),
        ("gu_row_bytes", ctypes.c_int64),
        ("down_row_bytes", ctypes.c_int64),
        *[(name, ctypes.c_int32) for name in ("q6", "h", "f", "up_g", "down_g", "threads")],
        *[(name, ctypes.c_int32) for name in ("t", "k")],
        *[(name, ctypes.c_void_p) for name in ("ids", "weights", "xq", "xd", "xs", "rows")],
        ("calls", ctypes.c_int64),
        ("assignments", ctypes.c_int64),
        ("nanoseconds", ctypes.c_int64),
        ("status", ctypes.c_int32),
    ]


class HostPoller(ctypes.Structure):
    """`experts.c`'s host_poller: a thread that runs host_layer(table[job]) when the GPU posts
    go = seq << 16 | job in flags[0], then stores done = seq in flags[1] (flags[2]: posts that
    named no table entry). Set flags, table, n, spin_ns and sleep_ns; then `start`, `halt`."""

    _fields_ = [
        ("flags", ctypes.c_void_p),
        ("table", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("spin_ns", ctypes.c_int64),
        ("sleep_ns", ctypes.c_int64),
        ("jobs", ctypes.c_int64),
        ("stop", ctypes.c_int),
        ("tid", ctypes.c_ulong),
    ]

    def start(self) -> None:
        rc = library().host_poller_start(ctypes.byref(self))
        if rc != 0:
            raise RuntimeError(f"cannot start the host poller thread (errno {rc})")

    def halt(self) -> None:
        library().host_poller_stop(ctypes.byref(self))


def host_layer_fn() -> int:
    """The address of `experts.c`'s host_layer(void *), a CUDA host function."""
    return ctypes.cast(library().host_layer, ctypes.c_void_p).value or 0


def _check_arrays(**arrays: tuple[np.ndarray, type]) -> None:
    """ValueError unless each named array is C-contiguous of its dtype (the C code takes raw
    pointers)."""
    for name, (a, dtype) in arrays.items():
        if a.dtype != dtype or not a.flags.c_contiguous:
            raise ValueError(f"{name} must be a contiguous {np.dtype(dtype).name} array")


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def gate_up_q4_k(
    gate: np.ndarray,
    up: np.ndarray,
    xq: np.ndarray,
    xd: np.ndarray,
    xs: np.ndarray,
    groups_per_step: int,
    rows: tuple[int, int] | None = None,
    out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    h_out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One token's h = silu(gate x) * (up x) of one expert, rounded to q8 blocks, with the bits
    of the GPU's "once" gate/up kernel (`experts.c`).

    gate, up: uint8 [F, K / 256 * 144] Q4_K rows; xq int8 [K], xd and xs float32 [K / 32] (x as
    `kernels.mmvq.quantize_q8` rounds it); groups_per_step: the launch's G. `rows` (n0, n1),
    multiples of 32, limits the work to those rows of `out` (hq int8 [F], hd, hs float32
    [F / 32]), which are allocated when not given; `h_out` (float32 [F]) gets h before its
    rounding."""
    f, row_bytes = gate.shape
    k = xq.shape[0]
    _check_arrays(gate=(gate, np.uint8), up=(up, np.uint8), xq=(xq, np.int8),
                  xd=(xd, np.float32), xs=(xs, np.float32))  # fmt: skip
    if up.shape != gate.shape or xd.shape != (k // 32,) or xs.shape != (k // 32,):
        raise ValueError("gate/up or the activation scales do not match")
    if out is None:
        out = (
            np.empty(f, np.int8),
            np.empty(f // 32, np.float32),
            np.empty(f // 32, np.float32),
        )
    hq, hd, hs = out
    n0, n1 = rows or (0, f)
    if h_out is not None and (h_out.dtype != np.float32 or h_out.shape != (f,)):
        raise ValueError(f"h_out must be float32 [{f}]")
    rc = library().gate_up_q4_k(
        _ptr(gate), _ptr(up), row_bytes, k, n0, n1, groups_per_step,
        _ptr(xq), _ptr(xd), _ptr(xs), _ptr(hq), _ptr(hd), _ptr(hs),
        None if h_out is None else _ptr(h_out),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(
            f"gate_up_q4_k cannot take K={k}, rows {n0}..{n1}, G={groups_per_step}, "
            f"{row_bytes}-byte rows"
        )
    return hq, hd, hs


def down_rows(
    down: np.ndarray,
    q6: bool,
    hq: np.ndarray,
    hd: np.ndarray,
    hs: np.ndarray,
    weight: float,
    groups_per_step: int,
    rows: tuple[int, int] | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """One expert's down projection of one assignment's q8 h (hq int8 [F], hd, hs float32
    [F / 32]) times its routing weight, with the bits of the reproducible down kernel's sum of
    one expert (`experts.c`; the kernel adds the token's experts' sums in selection order).
    down: uint8 [H, F / 256 * (210 if q6 else 144)] Q6_K or Q4_K rows; `rows` limits the work to
    those rows of `out` (float32 [H], allocated when not given)."""
    h, row_bytes = down.shape
    f = hq.shape[0]
    _check_arrays(down=(down, np.uint8), hq=(hq, np.int8), hd=(hd, np.float32),
                  hs=(hs, np.float32))  # fmt: skip
    if hd.shape != (f // 32,) or hs.shape != (f // 32,):
        raise ValueError("the q8 scales do not match hq")
    out = np.empty(h, np.float32) if out is None else out
    if out.dtype != np.float32 or out.shape != (h,):
        raise ValueError(f"out must be float32 [{h}]")
    n0, n1 = rows or (0, h)
    rc = library().down_rows(
        _ptr(down), row_bytes, int(q6), f, n0, min(n1, h), groups_per_step,
        _ptr(hq), _ptr(hd), _ptr(hs), float(weight), _ptr(out),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(
            f"down_rows cannot take F={f}, rows {n0}..{n1}, G={groups_per_step}, "
            f"{row_bytes}-byte rows"
        )
    return out


def moe_host_rows(
    experts: list[tuple[np.ndarray, np.ndarray, np.ndarray, bool]],
    tokens: list[int],
    weights: list[float],
    xq: np.ndarray,
    xd: np.ndarray,
    xs: np.ndarray,
    up_groups_per_step: int,
    down_groups_per_step: int,
    threads: int = 1,
) -> np.ndarray:
    """The weighted down sums of a layer's host-computed assignments (float32 [n, H]): the i-th
    is token tokens[i]'s expert experts[i] = (gate, up, down, down is Q6_K) (uint8 Q4_K gate/up
    rows [F, H / 256 * 144], down rows [H, F / 256 * (210 or 144)], as in the file) with routing
    weight weights[i]; each row as `gate_up_q4_k` then `down_rows` give it, computed by
    `threads` threads in one call (OpenMP where the build has it). xq int8 [T, H], xd and xs
    float32 [T, H / 32]: the tokens' q8 rows as the GPU rounded them."""
    n = len(experts)
    if not (len(tokens) == len(weights) == n):
        raise ValueError("experts, tokens and weights differ in length")
    t, h = xq.shape
    _check_arrays(xq=(xq, np.int8), xd=(xd, np.float32), xs=(xs, np.float32))
    if xd.shape != (t, h // 32) or xs.shape != (t, h // 32):
        raise ValueError("xq must be int8 [T, H] with xd, xs float32 [T, H / 32]")
    if n == 0:
        return np.empty((0, h), np.float32)
    f = experts[0][0].shape[0]
    for gate, up, down, _ in experts:
        _check_arrays(gate=(gate, np.uint8), up=(up, np.uint8), down=(down, np.uint8))
        if gate.shape != experts[0][0].shape or up.shape != gate.shape or down.shape[0] != h:
            raise ValueError("every expert's gate, up and down must have the layer's shape")
    if not all(0 <= v < t for v in tokens):
        raise ValueError("a token is out of range")
    down_bytes = np.array([d.shape[1] for _, _, d, _ in experts], np.int64)
    addr = [np.array([e[i].ctypes.data for e in experts], np.uint64) for i in range(3)]
    q6 = np.array([int(e[3]) for e in experts], np.int32)
    tok = np.array(tokens, np.int32)
    wt = np.array(weights, np.float32)
    hq = np.empty((n, f), np.int8)
    hd = np.empty((n, f // 32), np.float32)
    hs = np.empty((n, f // 32), np.float32)
    rows = np.empty((n, h), np.float32)
    rc = library().moe_host_rows(
        n, *(_ptr(a) for a in addr), _ptr(q6), _ptr(tok), _ptr(wt), experts[0][0].shape[1],
        _ptr(down_bytes), h, f, up_groups_per_step, down_groups_per_step,
        _ptr(xq), _ptr(xd), _ptr(xs), _ptr(hq), _ptr(hd), _ptr(hs), _ptr(rows), threads,
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"moe_host_rows cannot take H={h}, F={f} with these groups per step")
    return rows


@contextlib.contextmanager
def scalar_only() -> Iterator[None]:
    """Within the block the native code takes its portable scalar path (integer dot products
    and float arithmetic) even where the CPU has AVX2 (tests compare both)."""
    library().native_force_scalar(1)
    try:
        yield
    finally:
        library().native_force_scalar(0)


def silu_rn(g: np.ndarray) -> np.ndarray:
    """`experts.c`'s silu of float32 values (the GPU's `kernels.exact.silu_rn`)."""
    g = np.ascontiguousarray(g, dtype=np.float32)
    out = np.empty_like(g)
    library().silu_rn_n(_ptr(g), _ptr(out), g.size)
    return out


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's contiguous numpy view (copied when not contiguous)."""
    return t.detach().cpu().contiguous().numpy()
