"""bench/profile_steps.py's account of where the GPU waited, on made-up kernel spans."""

from __future__ import annotations

from tests.bench.scripts import load_bench_script


def test_idle_gaps_before_between_and_after_the_kernels() -> None:
    idle_gaps = load_bench_script("profile_steps").idle_gaps
    kernels = [  # us: two overlapping kernels count as one busy span
        (1000.0, 1500.0, "attention"),
        (1400.0, 2000.0, "moe_down"),
        (2300.0, 2400.0, "norm"),
        (4400.0, 4500.0, "sample"),
    ]
    text = idle_gaps(kernels, start=0.0, end=5000.0, top=2)
    lines = text.splitlines()
    assert lines[0] == (
        "GPU idle: 1.00 ms before the first kernel, 2.30 ms in 2 gaps between kernels, "
        "0.50 ms after the last"
    )
    assert "2000.0 us between norm and sample" in lines[1]  # the longest gap first
    assert "300.0 us between moe_down and norm" in lines[2]
    assert idle_gaps([], 0.0, 1.0) == "GPU idle: no kernels"
