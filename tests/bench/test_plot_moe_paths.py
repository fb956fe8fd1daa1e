"""`bench/plot_moe_paths.py` reads the MoE sweep logs kept in bench/results and plots them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.scripts import load_bench_script

ROOT = Path(__file__).resolve().parents[2]
LOGS = ROOT / "bench" / "results" / "2026-11-30-h200-d"


@pytest.fixture(scope="module")
def plot():
    return load_bench_script("plot_moe_paths")


def test_reads_the_paths_and_the_floor(plot) -> None:
    logs = [LOGS / "r3_sweep_moe_grouped.log", LOGS / "r5_sweep_moe_grouped_small.log"]
    times, floor = plot.read(logs)
    grouped = times["grouped (today's block for T)"]
    # the assignments a block grouped_config gives each T now: 2 at 16 tokens (both runs), 4 at 64
    assert grouped[16] == [154.7, 159.4] and grouped[64] == [366.4]
    assert times["mmq"][64] == [422.2] and times["mmvq"][8] == [111.7]
    assert all(0 < f < min(grouped[t]) for t in grouped for f in floor[t])


def test_writes_a_png(plot, tmp_path, monkeypatch) -> None:
    out = tmp_path / "moe.png"
    log = str(LOGS / "r5_sweep_moe_grouped_small.log")
    monkeypatch.setattr("sys.argv", ["plot_moe_paths.py", log, "--out", str(out)])
    assert plot.main() == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    monkeypatch.setattr("sys.argv", ["plot_moe_paths.py", str(empty), "--out", str(out)])
    assert plot.main() == 1
