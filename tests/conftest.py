"""Session-wide test setup: without CUDA, Triton kernels run in its CPU interpreter.

The switch must be set before triton is first imported (`triton.jit` reads it when a kernel is
defined), whichever test module happens to import a kernel module first; a per-module setting
comes too late when an earlier module already imported one. Two of the interpreter's costs that
change no result are then taken out (`_patch_language_once_per_launch`, `_no_overflow_checks`):
five kernel test files took 1,544 s before and 382 s after under Triton 3.9 (bench/RESULTS.md,
eighteenth session).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test`: one worker a core
    torch.set_num_threads(1)  # torch's own threads would only wait on each other's cores


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter patches `triton.language` (every builtin re-wrapped, found by
    `inspect.getmembers`) at each kernel launch, and again at each call of a `@triton.jit`
    helper inside the kernel, where the launch's patches are already in place (18% of the
    host-compute test's time in a profile). A helper call within a launch now skips the
    patching when its module sees no language module the launch has patched so far; the
    kernels compute the same values (the patches are the same functions). Versions without
    these internals run as they are."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None or getattr(original, "once", False):
        return
    launch: set = set()  # the language modules the running launch patched (launches never nest)

    def languages(fn) -> set:
        tl = interpreter.tl
        return {v for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_lang(fn):
        langs = languages(fn)
        if launch:  # a helper called within a launch (its scope is never restored)
            if langs <= launch:
                return scope_type()
            launch.update(langs)  # e.g. `tl.sum`'s module sees `tl.core`: patched from now on
            return original(fn)
        scope = original(fn)
        launch.update(langs)
        restore = scope.restore

        def restore_and_end() -> None:
            launch.clear()
            restore()

        scope.restore = restore_and_end
        return scope

    patch_lang.once = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang


def _no_overflow_checks() -> None:
    """The interpreter checks every 32-bit integer add, sub and mul for overflow (each one
    recomputed in 64 bits, compared with the bounds and asserted: about a third of the time of
    the integer-dot kernels), which a GPU build does only in debug mode. The tests compare the
    kernels' results with references computed without wrapping, which an overflow would fail."""
    try:
        import dataclasses

        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow"):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_language_once_per_launch()
    _no_overflow_checks()
