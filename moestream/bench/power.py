"""Board power of a GPU during a measured region, sampled through NVML.

    sampler = open_power_sampler(device)       # never raises; see `.available` / `.reason`
    with sampler.measure() as m:               # a background thread polls every ~50 ms
        run_the_thing()
    m.result()  # {"mean_power_w", "energy_j", "energy_source", "n_samples", "seconds"} or None

`pynvml` (the `nvidia-ml-py` package, `moestream[gpu]`) is imported lazily. Without it, off CUDA,
or when NVML refuses, the sampler is unavailable and every result is None, with the reason kept
in `.reason` for the report. Energy comes from the board's energy counter
(nvmlDeviceGetTotalEnergyConsumption, Volta and later) when it exists, else from the mean of the
power samples times the duration; `energy_source` says which.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import torch

DEFAULT_INTERVAL_S = 0.05


@dataclass
class PowerMeasurement:
    """One measured region. Filled by `PowerSampler.measure`; read with `result()`."""

    samples_w: list[float] = field(default_factory=list)
    seconds: float = 0.0
    energy_counter_j: float | None = None
    available: bool = False

    def result(self) -> dict[str, Any] | None:
        if not self.available or not self.samples_w:
            return None
        mean_w = sum(self.samples_w) / len(self.samples_w)
        counter = self.energy_counter_j
        use_counter = counter is not None and counter > 0
        return {
            "mean_power_w": mean_w,
            "energy_j": counter if use_counter else mean_w * self.seconds,
            "energy_source": "counter" if use_counter else "mean_power",
            "n_samples": len(self.samples_w),
            "seconds": self.seconds,
        }


class PowerSampler:
    """Polls one GPU's board power in a background thread while a region runs."""

    def __init__(
        self,
        handle: Any = None,
        nvml: Any = None,
        reason: str | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
    ):
        self._handle = handle
        self._nvml = nvml
        self.reason = reason  # why power is not measured (None when it is)
        self.interval_s = interval_s

    @property
    def available(self) -> bool:
        return self._handle is not None

    def _power_w(self) -> float:
        return self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0  # mW -> W

    def _energy_mj(self) -> int | None:
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except Exception:  # not supported on this board
            return None

    @contextmanager
    def measure(self):
        """Context manager yielding a PowerMeasurement filled when the block exits."""
        m = PowerMeasurement(available=self.available)
        if not self.available:
            start = time.perf_counter()
            yield m
            m.seconds = time.perf_counter() - start
            return
        stop = threading.Event()

        def poll() -> None:
            while True:
                with suppress(Exception):  # a missed reading is skipped, not fatal
                    m.samples_w.append(self._power_w())
                if stop.wait(self.interval_s):
                    return

        e0 = self._energy_mj()
        thread = threading.Thread(target=poll, name="moestream-power", daemon=True)
        start = time.perf_counter()
        thread.start()
        try:
            yield m
        finally:
            m.seconds = time.perf_counter() - start
            e1 = self._energy_mj()
            stop.set()
            thread.join()
            if e0 is not None and e1 is not None:
                m.energy_counter_j = (e1 - e0) / 1000.0
            if not m.samples_w:  # a region shorter than one poll: take one reading now
                with suppress(Exception):
                    m.samples_w.append(self._power_w())

    def close(self) -> None:
        if self._nvml is not None:
            with suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = self._handle = None


def _nvml_handle(nvml: Any, device: torch.device) -> Any:
    """The NVML handle of the torch device: by UUID (CUDA_VISIBLE_DEVICES renumbers devices
    for torch but not for NVML), by index as a fallback."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        for candidate in (text if text.startswith("GPU-") else f"GPU-{text}", text):
            try:
                return nvml.nvmlDeviceGetHandleByUUID(candidate)
            except Exception:
                continue
    return nvml.nvmlDeviceGetHandleByIndex(index)


def open_power_sampler(
    device: torch.device | str, interval_s: float = DEFAULT_INTERVAL_S
) -> PowerSampler:
    """A sampler for `device`; an unavailable one (with `.reason`) instead of raising."""
    device = torch.device(device)
    if device.type != "cuda":
        return PowerSampler(reason=f"no board power on device {device} (NVML covers CUDA GPUs)")
    try:
        import pynvml
    except ImportError:
        return PowerSampler(reason="pynvml is not installed (pip install nvidia-ml-py)")
    try:
        pynvml.nvmlInit()
    except Exception as e:
        return PowerSampler(reason=f"NVML did not initialise: {e}")
    try:
        handle = _nvml_handle(pynvml, device)
        pynvml.nvmlDeviceGetPowerUsage(handle)
    except Exception as e:
        pynvml.nvmlShutdown()
        return PowerSampler(reason=f"NVML gives no power reading for {device}: {e}")
    return PowerSampler(handle, pynvml, interval_s=interval_s)
