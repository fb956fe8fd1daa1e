"""`moestream bench --compare`: A/B of two configurations or two checkouts on one machine.

Each side runs as a child process (`python -m moestream.cli bench ... --json-only`), A and B
interleaved A B B A A B B A ... so that drift of the machine (clocks, heat, other load) falls on
both sides alike. Every child does its own warm-up and repeats; the samples of all children of a
side are pooled per metric (so the spread covers run-to-run and process-to-process variation).

Per metric: ratio = median(B) / median(A); spread of a side = (max - min) / median of its
samples. Verdict: "noise" when |ratio - 1| is within the larger of the two spreads; otherwise
"faster"/"slower" for throughput (higher is better), "better"/"worse" for the rest (J/token);
"too few samples" when a side has fewer than two (no spread can be measured).
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moestream.bench.machine import git_info, run_info
from moestream.bench.runner import result_metrics
from moestream.errors import RequestError

COMPARE_SCHEMA = "moestream.bench.compare/1"
# Child bootstrap for a checkout: argv[1] is the checkout, put first on sys.path.
_BOOT = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); sys.argv[0] = 'moestream/cli.py'; "
    "from moestream.cli import main; sys.exit(main())"
)


def spread(samples: Sequence[float]) -> float:
    """(max - min) / median: the relative width of repeated measurements."""
    med = statistics.median(samples)
    return (max(samples) - min(samples)) / abs(med) if med else float("inf")


def verdict(
    a: Sequence[float], b: Sequence[float], higher_is_better: bool = True
) -> dict[str, Any]:
    """Medians, ratio B/A, spreads and the verdict for one metric (see the module docstring)."""
    if not a or not b:
        raise ValueError("verdict needs samples on both sides")
    med_a, med_b = statistics.median(a), statistics.median(b)
    ratio = med_b / med_a if med_a else float("inf")
    spread_a, spread_b = spread(a), spread(b)
    if len(a) < 2 or len(b) < 2:
        word = "too few samples"
    elif abs(ratio - 1.0) <= max(spread_a, spread_b):
        word = "noise"
    else:
        good = ratio > 1.0 if higher_is_better else ratio < 1.0
        if higher_is_better:
            word = "faster" if good else "slower"
        else:
            word = "better" if good else "worse"
    return {
        "median_a": med_a,
        "median_b": med_b,
        "ratio": ratio,
        "spread_a": spread_a,
        "spread_b": spread_b,
        "verdict": word,
    }


def interleaved_order(rounds: int) -> list[str]:
    """A B B A A B B A ...: `rounds` runs of each side, each pair's order alternating."""
    if rounds < 1:
        raise RequestError(f"--rounds must be >= 1, got {rounds}")
    return [side for i in range(rounds) for side in (("A", "B") if i % 2 == 0 else ("B", "A"))]


@dataclass(frozen=True)
class Side:
    """One configuration: extra CLI arguments and the checkout whose moestream runs it."""

    label: str  # "A" | "B"
    args: tuple[str, ...] = ()
    checkout: Path | None = None  # None: the moestream this process runs

    def command(self) -> list[str]:
        """The interpreter command that runs this side's `moestream.cli` with the arguments
        that follow. A checkout goes first on sys.path: PYTHONPATH alone loses to the working
        directory that `python -m` puts in front of it."""
        if self.checkout is None:
            return [sys.executable, "-m", "moestream.cli"]
        return [sys.executable, "-c", _BOOT, str(self.checkout)]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.checkout is not None:
            old = env.get("PYTHONPATH")
            env["PYTHONPATH"] = str(self.checkout) + (os.pathsep + old if old else "")
        return env

    def describe(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "args": shlex.join(self.args),
            "checkout": None if self.checkout is None else str(self.checkout),
            "git": git_info(self.checkout),
        }


def sides_from_args(
    compare: Sequence[str] | None, checkouts: Sequence[str] | None
) -> tuple[Side, Side]:
    """`--compare "ARGS_A" "ARGS_B"` and/or `--compare-checkouts DIR_A DIR_B` -> (A, B)."""
    args = [tuple(shlex.split(x)) for x in compare] if compare else [(), ()]
    dirs: list[Path | None] = [None, None]
    if checkouts:
        dirs = []
        for d in checkouts:
            p = Path(d).resolve()
            if not (p / "moestream" / "__init__.py").is_file():
                raise RequestError(f"--compare-checkouts: {d} holds no moestream/__init__.py")
            dirs.append(p)
    return Side("A", args[0], dirs[0]), Side("B", args[1], dirs[1])


def run_child(side: Side, base_args: Sequence[str], out_dir: Path) -> dict[str, Any]:
    """One child bench run of `side`; returns its result JSON. The child's output goes to our
    stderr; a failed child raises RuntimeError with its exit status."""
    cmd = [*side.command(), "bench", *base_args, *side.args, "--json-only", "--out", str(out_dir)]
    r = subprocess.run(cmd, env=side.env(), stdout=sys.stderr, stderr=sys.stderr)
    if r.returncode != 0:
        raise RuntimeError(
            f"bench run of side {side.label} failed (exit {r.returncode}): {shlex.join(cmd)}"
        )
    result = json.loads((out_dir / "result.json").read_text())
    if side.checkout is not None:
        ran = Path(result["git"]["path"]).resolve()
        if ran != side.checkout:
            raise RuntimeError(
                f"side {side.label} was to run the checkout {side.checkout} but ran {ran} "
                "(another moestream came first on sys.path)"
            )
    return result


def compare_results(
    results_a: Sequence[dict[str, Any]], results_b: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per metric present on both sides: pooled samples and `verdict`."""
    pooled: dict[str, dict[str, Any]] = {}
    for side, results in (("a", results_a), ("b", results_b)):
        for res in results:
            for m in result_metrics(res):
                entry = pooled.setdefault(
                    m.name,
                    {
                        "metric": m.name,
                        "unit": m.unit,
                        "higher_is_better": m.higher_is_better,
                        "a": [],
                        "b": [],
                    },
                )
                entry[side].extend(m.samples)
    rows = []
    for entry in pooled.values():
        if entry["a"] and entry["b"]:
            rows.append({**entry, **verdict(entry["a"], entry["b"], entry["higher_is_better"])})
    return rows


def run_compare(
    sides: tuple[Side, Side],
    base_args: Sequence[str],
    rounds: int,
    work_dir: Path | None = None,
    argv: Sequence[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the interleaved A/B and return the comparison JSON (schema COMPARE_SCHEMA)."""
    order = interleaved_order(rounds)
    by_label = {s.label: s for s in sides}
    results: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    runs = []
    with tempfile.TemporaryDirectory(prefix="moestream-compare-") as tmp:
        root = Path(work_dir) if work_dir is not None else Path(tmp)
        for i, label in enumerate(order):
            if log:
                log(f"compare: run {i + 1}/{len(order)}: side {label}")
            out = root / f"run{i:02d}-{label}"
            res = run_child(by_label[label], base_args, out)
            results[label].append(res)
            runs.append(
                {
                    "index": i,
                    "side": label,
                    "command": res["run"]["command"],
                    "date": res["run"]["date"],
                    "git": res["git"],
                }
            )
    first = results["A"][0]
    return {
        "schema": COMPARE_SCHEMA,
        "run": run_info(argv),
        "machine": first["machine"],
        "model": first["model"],
        "sides": {"A": sides[0].describe(), "B": sides[1].describe()},
        "base_args": shlex.join(base_args),
        "order": order,
        "runs": runs,
        "metrics": compare_results(results["A"], results["B"]),
        "results": {"A": results["A"], "B": results["B"]},
    }
