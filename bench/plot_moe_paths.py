"""Plot the fused MoE's paths against the tokens in a step, from the logs of
`bench/kernels_gpu.py --sweep-moe-grouped` / `--sweep-moe-grouped-small` (one Qwen3-30B-A3B
layer): us per layer of mmvq, mmq and the grouped path with the assignments a block that
`moe_grouped.grouped_config` gives each T now and the sweep's other fields (`MoeGroupedConfig()`:
the logs predate the one-warp gate/up default, whatever a log marked as its default then), and
the time the routed experts' bytes take at the copy bandwidth the log measured (the floor).

    python bench/plot_moe_paths.py LOG [LOG ...] --out moe_paths.png

Where two logs time the same T, the plot shows their mean.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from moestream.kernels.moe_grouped import MoeGroupedConfig, grouped_config  # noqa: E402

ROW = re.compile(r"^\s+T=\s*(\d+)\s+([\d.]+) us\s+([\d,]+) GB/s\s+\d+%\s+err \S+\s+(.*)$")
COPY = re.compile(r"^copy bandwidth ([\d,]+) GB/s")


def swept_shape(t: int) -> MoeGroupedConfig:
    """The logged grouped shape for T tokens of 8 experts in 128: today's assignments a block,
    the sweep's defaults for the rest."""
    return replace(MoeGroupedConfig(), block_m=grouped_config(t * 8, 128).block_m)


def logged_shape(label: str) -> MoeGroupedConfig | None:
    """The grouped shape a sweep row names ("grouped MoeGroupedConfig(block_m=2, ...)"); fields
    the log predates (`chain`) take their defaults."""
    if not label.startswith("grouped MoeGroupedConfig("):
        return None
    fields = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", label)}
    return replace(MoeGroupedConfig(), **fields)


def read(paths: list[Path]) -> tuple[dict[str, dict[int, list[float]]], dict[int, list[float]]]:
    """(path -> T -> us of each log, T -> floor us of each log) from the sweep logs."""
    times: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    floor: dict[int, list[float]] = defaultdict(list)
    for path in paths:
        copy_gbs = None
        for line in path.read_text().splitlines():
            if m := COPY.match(line):
                copy_gbs = float(m.group(1).replace(",", ""))
            m = ROW.match(line)
            if not m:
                continue
            t, us, gbs, label = int(m.group(1)), float(m.group(2)), m.group(3), m.group(4)
            if label.startswith(("mmvq", "mmq")):
                name = label.split()[0]
                if name == "mmvq" and copy_gbs:  # bytes read = us * GB/s
                    floor[t].append(us * float(gbs.replace(",", "")) / copy_gbs)
            elif logged_shape(label.removesuffix(" (default)")) == swept_shape(t):
                name = "grouped (today's block for T)"
            else:
                continue
            times[name][t].append(us)
    return times, floor


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    times, floor = read(args.logs)
    if not times:
        print("no sweep rows in the logs", file=sys.stderr)
        return 1
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, by_t in sorted(times.items()):
        ts = sorted(by_t)
        ax.plot(ts, [statistics.mean(by_t[t]) for t in ts], marker="o", label=name)
    ts = sorted(floor)
    ax.plot(
        ts, [statistics.mean(floor[t]) for t in ts], "k--", label="experts' bytes at copy bandwidth"
    )
    ax.set_xlabel("tokens in the step (8 experts each, 128 in the layer)")
    ax.set_ylabel("us per MoE layer")
    ax.set_title("Qwen3-30B-A3B MoE layer (Q4_K gate/up, Q6_K down), H200")
    ax.set_xticks(sorted({t for by_t in times.values() for t in by_t}))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
