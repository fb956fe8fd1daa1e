"""The disk tier: whole experts read from the GGUF file by positional reads (`os.preadv`), on
any thread, into caller-given CPU buffers (pinned host slots or staging buffers).

Expert e of a stacked tensor is the contiguous byte range offset + e * expert_bytes; an expert is
three such ranges (gate, up, down). With `direct=True` the file is opened with O_DIRECT (no page
cache): reads then cover the enclosing 4096-byte-aligned range into an aligned bounce buffer of
the calling thread; a filesystem that refuses O_DIRECT falls back to buffered reads
(`direct_active` says which). Buffered reads advise the kernel that access is random (no
read-ahead past the expert) and `will_need` hints it at experts that are about to be read.

An unreadable or short read raises `ExpertReadError`, naming the file, layer, expert and tensor.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from moestream.errors import ModelFormatError
from moestream.experts.placement import ExpertLayout

DIRECT_ALIGN = 4096


class ExpertReadError(ModelFormatError):
    """An expert's bytes could not be read from the model file (I/O error, file cut short)."""


def _as_buffer(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous uint8 CPU tensor (shares its memory)."""
    if t.device.type != "cpu" or t.dtype != torch.uint8 or not t.is_contiguous():
        raise ValueError(f"read target must be a contiguous uint8 CPU tensor, got {t.dtype}")
    return memoryview(t.numpy()).cast("B")


def drop_page_cache(path: str | os.PathLike[str]) -> bool:
    """Ask the kernel to drop `path`'s clean pages from the page cache, without root
    (`POSIX_FADV_DONTNEED` over the whole file), so the next reads come from the disk: the
    "rest on disk, cold cache" case of a benchmark. Pages some process has mapped (e.g. tensors
    the loader read through its memory map) stay; experts are read with `preadv`, so theirs
    go. Returns False where the platform has no posix_fadvise (nothing dropped). Raises
    ExpertReadError when the file cannot be opened."""
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ExpertReadError(f"{path}: cannot open the model file ({e.strerror})") from None
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


class ExpertFileReader:
    """Positional reads of whole experts from one GGUF file; safe to call from many threads."""

    def __init__(self, layout: ExpertLayout, path: str | os.PathLike[str] | None = None,
                 direct: bool = False):  # fmt: skip
        self.layout = layout
        self.path = Path(path) if path is not None else layout.path
        self.direct_active = False
        self._local = threading.local()
        try:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            msg = f"{self.path}: cannot open the model file ({e.strerror})"
            raise ExpertReadError(msg) from None
        self._direct_fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._direct_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
                self.direct_active = True
            except OSError:
                self._direct_fd = -1  # e.g. tmpfs: EINVAL; buffered reads still work
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)

    def close(self) -> None:
        for fd in (self._fd, self._direct_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._direct_fd = -1

    def __enter__(self) -> ExpertFileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def expert_ranges(self, layer: int, e: int) -> list[tuple[str, int, int]]:
        """(tensor name, file offset, bytes) of expert `e` of `layer`: gate, up, down."""
        return [(t.name, t.offset(e), t.expert_bytes) for t in self.layout.layers[layer]]

    def will_need(self, layer: int, experts: Sequence[int]) -> None:
        """Hint the kernel to start reading these experts into the page cache."""
        if self.direct_active or not hasattr(os, "posix_fadvise"):
            return
        for e in experts:
            for _, offset, n in self.expert_ranges(layer, e):
                os.posix_fadvise(self._fd, offset, n, os.POSIX_FADV_WILLNEED)

    def read_expert(self, layer: int, e: int, out: Sequence[torch.Tensor]) -> int:
        """Read expert `e` of `layer` into `out` = (gate, up, down) uint8 CPU buffers of exactly
        the expert's bytes each; returns the bytes read. Raises ExpertReadError."""
        total = 0
        for (name, offset, n), dst in zip(self.expert_ranges(layer, e), out, strict=True):
            if dst.numel() != n:
                raise ValueError(f"buffer of {dst.numel()} bytes for {n} bytes of {name}")
            try:
                if self.direct_active:
                    self._read_direct(offset, n, dst)
                else:
                    self._read(offset, n, _as_buffer(dst))
            except OSError as err:
                raise ExpertReadError(
                    f"{self.path}: cannot read expert {e} of layer {layer} ({name}, {n} bytes at "
                    f"offset {offset}): {err.strerror or err}"
                ) from None
            except EOFError as err:
                raise ExpertReadError(
                    f"{self.path}: short read of expert {e} of layer {layer} ({name}): {err} "
                    f"(the file was truncated or replaced?)"
                ) from None
            total += n
        return total

    def _read(self, offset: int, n: int, buf: memoryview) -> None:
        done = 0
        while done < n:
            got = os.preadv(self._fd, [buf[done:n]], offset + done)
            if got == 0:
                raise EOFError(f"got {done} of {n} bytes at offset {offset}")
            done += got

    def _bounce(self, n: int) -> np.ndarray:
        """This thread's aligned bounce buffer of at least `n` bytes."""
        buf = getattr(self._local, "bounce", None)
        if buf is None or buf.nbytes < n:
            raw = np.empty(n + DIRECT_ALIGN, dtype=np.uint8)
            start = -raw.ctypes.data % DIRECT_ALIGN
            buf = raw[start : start + n]
            self._local.bounce = buf
        return buf

    def _read_direct(self, offset: int, n: int, dst: torch.Tensor) -> None:
        start = offset - offset % DIRECT_ALIGN
        end = -(-(offset + n) // DIRECT_ALIGN) * DIRECT_ALIGN
        bounce = self._bounce(end - start)
        view = memoryview(bounce)
        done = 0
        while done < end - start:
            try:
                got = os.preadv(self._direct_fd, [view[done : end - start]], start + done)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                self.direct_active = False  # alignment refused after all: buffered from now on
                self._read(offset, n, _as_buffer(dst))
                return
            done += got
            if got == 0 or got % DIRECT_ALIGN:
                break  # end of file: fine when it is past the expert
        if done < offset + n - start:
            raise EOFError(f"got {max(done - (offset - start), 0)} of {n} bytes at offset {offset}")
        dst.copy_(torch.from_numpy(bounce[offset - start : offset - start + n]))
