"""Where and how a benchmark ran: the machine, the accelerator, the software, the checkout;
and the device's copy bandwidth, the denominator of the bandwidth ceiling.

Every figure moestream prints is tied to this record (DESIGN.md, "Measuring"): a number without
its machine, driver, commit and command cannot be compared with another one.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
import torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _nvidia_driver() -> str | None:
    try:
        import pynvml  # nvidia-ml-py; optional

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # absent library, no driver, no permission: the field stays null
        return None


def gpu_info(device: torch.device) -> dict[str, Any] | None:
    """Name, memory, compute capability, driver and CUDA version of `device`; None off CUDA."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {
        "index": index,
        "name": props.name,
        "memory_bytes": int(props.total_memory),
        "compute_capability": f"{props.major}.{props.minor}",
        "multiprocessors": int(props.multi_processor_count),
        "driver": _nvidia_driver(),
        "cuda": torch.version.cuda,
    }


def git_info(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Commit and dirty flag of the checkout holding `path` (default: this package).

    Fields are null when `path` is not in a git checkout or git is missing. A copy of a tree
    without its own history (a benchmark machine given the files alone) can say which commit it
    is in the environment variable MOESTREAM_COMMIT; that wins (with `dirty` null), since
    the git found above such a copy may be an unrelated one.
    """
    where = Path(path) if path is not None else Path(__file__).resolve().parents[2]
    stated = os.environ.get("MOESTREAM_COMMIT")
    if stated:
        return {"path": str(where), "commit": stated, "dirty": None}

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(
                ["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "path": str(where),
        "commit": commit,
        "dirty": bool(status) if status is not None else None,
    }


def machine_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """The host, its CPU and RAM, the accelerator and the versions of what runs on it."""
    device = torch.device(device)
    vm = psutil.virtual_memory()
    return {
        "hostname": socket.gethostname(),
        "os": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_cores_logical": psutil.cpu_count(logical=True),
        "cpu_cores_physical": psutil.cpu_count(logical=False),
        "ram_bytes": int(vm.total),
        "device": str(device),
        "gpu": gpu_info(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "moestream": _version("moestream"),
    }


def run_info(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The command line as typed (shell-quoted), the working directory and the date (UTC)."""
    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0].endswith(os.path.join("moestream", "cli.py")):
        argv[0:1] = [Path(sys.executable).name, "-m", "moestream.cli"]  # python -m moestream.cli
    return {
        "command": shlex.join(argv),
        "cwd": os.getcwd(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(
    device: torch.device | str, nbytes: int | None = None, repeats: int = 10
) -> float:
    """Device-to-device copy bandwidth in GB/s (1e9 bytes), counting bytes read + written:
    the median of `repeats` copies of an `nbytes` buffer (default 1 GiB on CUDA, 64 MiB
    elsewhere) after one untimed copy. On CUDA, a buffer that does not fit is halved down to
    64 MiB before giving up."""
    device = torch.device(device)
    if nbytes is None:
        nbytes = 2**30 if device.type == "cuda" else 64 * 2**20
    while True:
        try:
            src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
            dst = torch.empty_like(src)
            break
        except torch.OutOfMemoryError:
            if nbytes <= 64 * 2**20:
                raise
            nbytes //= 2
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / statistics.median(times) / 1e9
