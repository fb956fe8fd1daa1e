"""`bench/disk_read.py`: the store's reader over random whole experts of the demo GGUF, and the
tok/s ceiling it implies."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from moestream.cli import DEMO_MODEL
from tests.bench.scripts import load_bench_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def disk_read():
    return load_bench_script("disk_read")


@pytest.mark.parametrize("buffered", [False, True])
def test_rates_and_the_ceiling_they_imply(disk_read, monkeypatch, capsys, buffered) -> None:
    argv = ["disk_read.py", str(DEMO_MODEL), "--threads", "1,2", "--experts", "12"]
    argv += ["--rounds", "2", "--on-device", "0.5,1"] + (["--buffered"] if buffered else [])
    monkeypatch.setattr(sys, "argv", argv)
    assert disk_read.main() == 0
    out = capsys.readouterr().out
    rates = [float(r) for r in re.findall(r"^\| [12] \| ([\d.]+) \|", out, re.M)]
    assert len(rates) == 2 and min(rates) > 0
    best = float(re.search(r"best rate \(([\d.]+) GB/s\)", out).group(1))
    assert best == pytest.approx(max(rates), abs=0.006)  # both printed to 2 decimals
    mb, ceiling = re.search(r"^\| 50% \| ([\d.,]+) \| ([\d.]+) \|", out, re.M).groups()
    # half of the top-2 experts miss: one expert a layer, 6 layers, from the file
    assert float(ceiling) == pytest.approx(best * 1e3 / float(mb), rel=0.1)  # printed rounded
    assert re.search(r"^\| 100% \| 0\.0 \| inf \|", out, re.M)  # nothing to read


def test_too_many_experts_is_refused(disk_read, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["disk_read.py", str(DEMO_MODEL), "--experts", "49"])
    with pytest.raises(SystemExit):
        disk_read.main()
