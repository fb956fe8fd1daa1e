"""Bench results on disk: result.json, result.md (markdown tables) and result.png (plot).

`write_report(result, out_dir)` handles both a single run (schema moestream.bench/1) and an A/B
comparison (moestream.bench.compare/1). Tables come from each section's `table()`, so sections
added later appear without changes here. Plots use matplotlib's Agg backend (no display).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moestream.bench.compare import COMPARE_SCHEMA
from moestream.bench.runner import SECTIONS, Section, md_table, section_markdown


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _header(result: dict[str, Any]) -> list[str]:
    m, model = result["machine"], result["model"]
    gpu = m.get("gpu")
    device = (
        f"{gpu['name']} ({gpu['memory_bytes'] / 2**30:.0f} GiB, driver {gpu['driver']}, "
        f"CUDA {gpu['cuda']})"
        if gpu
        else f"{m['device']} ({m['cpu']})"
    )
    lines = [
        f"- model: `{model['path']}` ({model['architecture']}, {model.get('file_type') or '-'}, "
        f"{_size(model['file_size'])})",
        f"- machine: {m['hostname']}, {device}, {m['cpu_cores_logical']} CPU threads, "
        f"{m['ram_bytes'] / 2**30:.0f} GiB RAM",
        f"- software: torch {m['torch']}, triton {m['triton'] or '-'}, python {m['python']}",
        f"- command: `{result['run']['command']}` ({result['run']['date']})",
    ]
    git = result.get("git")
    if git:
        dirty = " (dirty)" if git.get("dirty") else ""
        lines.insert(3, f"- commit: {git.get('commit') or 'unknown'}{dirty}")
    return lines


def format_markdown(result: dict[str, Any], sections: tuple[Section, ...] = SECTIONS) -> str:
    """A single run as markdown: provenance, one table per section, memory, power, skips."""
    if result.get("schema") == COMPARE_SCHEMA:
        return format_compare_markdown(result)
    cfg = result["config"]
    lines = ["# moestream bench", "", *_header(result)]
    temperature = cfg.get("temperature", 0.0)  # results written before --temperature: greedy
    sampling = f"sampled at temperature {temperature:g}" if temperature > 0 else "greedy"
    lines.append(
        f"- settings: repeats {cfg['repeats']}, warm-up {cfg['warmup']}, seed {cfg['seed']}, "
        f"decode tokens {cfg['decode_tokens']} ({sampling}); prompts: {cfg['prompt_token_ids']}"
    )
    bw = result.get("copy_bandwidth")
    if bw and bw.get("gbps"):
        lines.append(f"- copy bandwidth: {bw['gbps']:,.1f} GB/s ({bw['source']}, {bw['counts']})")
    for s in sections:
        if s.name in result:
            lines += ["", *section_markdown(s, result[s.name])]
    mem = result["memory"]
    lines += ["", "## memory", ""]
    gpu = mem["gpu_peak_bytes"]
    lines.append(f"- GPU peak allocated: {'-' if gpu is None else f'{gpu / 2**30:.2f} GiB'}")
    lines.append(f"- host peak RSS: {mem['host_peak_rss_bytes'] / 2**30:.2f} GiB")
    power = result["power"]
    if not power["available"]:
        lines.append(f"- board power: not measured ({power['reason']})")
    if result.get("skipped"):
        lines += ["", "## skipped", ""]
        lines += [f"- {s['section']} {s['tokens']:,}: {s['reason']}" for s in result["skipped"]]
    return "\n".join(lines) + "\n"


def format_compare_markdown(result: dict[str, Any]) -> str:
    """An A/B comparison as markdown: sides, order, and per metric medians, ratio, verdict."""
    sa, sb = result["sides"]["A"], result["sides"]["B"]

    def side(s: dict[str, Any]) -> str:
        git = s["git"] or {}
        where = s["checkout"] or "this checkout"
        return (
            f"`{s['args'] or '(no extra args)'}` in {where} "
            f"(commit {git.get('commit') or 'unknown'}{' dirty' if git.get('dirty') else ''})"
        )

    lines = [
        "# moestream bench --compare",
        "",
        *_header({**result, "git": None}),
        f"- A: {side(sa)}",
        f"- B: {side(sb)}",
        f"- order: {' '.join(result['order'])}; base args: `{result['base_args']}`",
        "- verdict: noise when |B/A - 1| is within the larger spread (max-min)/median",
        "",
    ]
    head = ["metric", "A median", "B median", "B/A", "spread A", "spread B", "verdict"]
    rows = [
        [
            m["metric"],
            f"{m['median_a']:,.4g}",
            f"{m['median_b']:,.4g}",
            f"{m['ratio']:.3f}",
            f"{100 * m['spread_a']:.1f}%",
            f"{100 * m['spread_b']:.1f}%",
            m["verdict"],
        ]
        for m in result["metrics"]
    ]
    return "\n".join(lines + md_table(head, rows)) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """tok/s vs tokens for prefill and decode (min-max as error bars), or B/A ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if result.get("schema") == COMPARE_SCHEMA:
        _plot_compare(result, path, plt)
        return
    panels = [
        (name, key, label)
        for name, key, label in (
            ("prefill", "prompt_tokens", "prompt tokens"),
            ("decode", "depth", "context depth (tokens)"),
        )
        if name in result
    ]
    fig, axes = plt.subplots(
        1, max(len(panels), 1), figsize=(5.5 * max(len(panels), 1), 4), squeeze=False
    )
    for ax, (name, key, label) in zip(axes[0], panels, strict=False):
        rows = result[name]["rows"]
        x = list(range(len(rows)))
        med = [r["tok_s"]["median"] for r in rows]
        lo = [m - r["tok_s"]["min"] for m, r in zip(med, rows, strict=True)]
        hi = [r["tok_s"]["max"] - m for m, r in zip(med, rows, strict=True)]
        ax.errorbar(x, med, yerr=[lo, hi], marker="o", capsize=4, label="measured (median)")
        ceil = [r.get("ceiling_tok_s") for r in rows]
        if name == "decode" and all(c is not None for c in ceil):
            ax.plot(x, ceil, linestyle="--", color="gray", label="bandwidth ceiling")
            ax.set_yscale("log")
        ax.set_xticks(x, [f"{r[key]:,}" for r in rows])
        ax.set_xlabel(label)
        ax.set_ylabel("tok/s")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend()
    if not panels:
        axes[0][0].text(0.5, 0.5, "no rows measured", ha="center", va="center")
    model = Path(result["model"]["path"]).name
    gpu = result["machine"].get("gpu")
    fig.suptitle(f"{model} on {gpu['name'] if gpu else result['machine']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_compare(result: dict[str, Any], path: Path, plt: Any) -> None:
    metrics = result["metrics"]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.8 * len(metrics) + 2), 4))
    x = list(range(len(metrics)))
    ratios = [m["ratio"] for m in metrics]
    bands = [max(m["spread_a"], m["spread_b"]) for m in metrics]
    colors = [
        "gray"
        if m["verdict"] in ("noise", "too few samples")
        else ("tab:green" if m["verdict"] in ("faster", "better") else "tab:red")
        for m in metrics
    ]
    ax.bar(x, ratios, color=colors)
    ax.errorbar(
        x,
        [1.0] * len(x),
        yerr=bands,
        fmt="none",
        ecolor="black",
        capsize=4,
        label="noise band (larger spread)",
    )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(x, [m["metric"] for m in metrics], rotation=45, ha="right")
    ax.set_ylabel("B / A (median)")
    ax.set_title("moestream bench --compare")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(result: dict[str, Any], out_dir: str | Path, json_only: bool = False) -> Path:
    """Write result.json (and unless `json_only`, result.md and result.png) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    if not json_only:
        (out / "result.md").write_text(format_markdown(result))
        plot(result, out / "result.png")
    return out
