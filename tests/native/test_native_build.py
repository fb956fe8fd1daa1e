"""Building the native code: where it cannot be built, one clear error (and the same one again,
without a second try); a build lands in the cache directory, keyed so that a changed source
builds anew."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = r"""
from moestream import native
for _ in range(2):
    try:
        native.library()
        print("built")
    except native.NativeUnavailable as e:
        print("unavailable:", e)
"""


def run_probe(tmp_path: Path, **env: str) -> list[str]:
    full = {**os.environ, "MOESTREAM_CACHE_DIR": str(tmp_path), **env}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         env=full, cwd=ROOT, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()


def test_no_compiler_is_one_clear_error(tmp_path: Path) -> None:
    lines = run_probe(tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert lines == [f"unavailable: no C compiler ({str(tmp_path / 'no-such-cc')!r} not found; "
                     "set CC)"] * 2  # fmt: skip


def test_a_failing_compiler_is_one_clear_error(tmp_path: Path) -> None:
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'cc: out of luck' >&2\nexit 1\n")
    cc.chmod(0o755)
    lines = run_probe(tmp_path, CC=str(cc))
    assert len(lines) == 2 and lines[0] == lines[1]
    assert lines[0].startswith("unavailable: cannot build experts.c") and "out of luck" in lines[0]
    assert not list((tmp_path / "native").glob("*.so"))
