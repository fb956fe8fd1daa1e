"""llama.cpp's own speculative decoding on the same tiny pair and prompts as bench/spec_figures.py:
plain decode, n-gram lookup (llama-lookup) and the draft model (llama-speculative), greedy, one
thread, the tok/s each tool prints and its draft acceptance. Plain decode is llama-lookup with
no drafts (`--spec-draft-n-max 0`): the same loop and prompt handling, one token per step
(llama-simple's loop measured ~10x slower than llama-bench's tg on this model, so it is not a
fair baseline).

    python bench/llamacpp_spec.py LLAMA_BIN_DIR [--tokens 128] [--prompts 3] [--rounds 3]
                                  [--draft-max 4] [--ngl 99] [--json out.json]

`--ngl N` offloads N layers of both models to the GPU (a CUDA build: `bench/scripts/
build_llamacpp.sh SRC BUILD 90 "llama-lookup llama-speculative"`); default 0, the CPU.

LLAMA_BIN_DIR holds llama-lookup and llama-speculative built from llama.cpp's
source (it ships in the llama-cpp-python sdist: `pip download --no-deps --no-binary :all:
llama-cpp-python`, then `cmake -S vendor/llama.cpp -B build -DLLAMA_BUILD_EXAMPLES=ON` and
`cmake --build build --target llama-lookup llama-speculative`).

Each round runs every tool on every prompt, in a rotated order; a row reports the median over
rounds of the per-prompt-summed tok/s ("decoded N tokens in T s" lines), the median speedup
over plain decode of the same round and prompts, and the acceptance (accepted / drafted) the
tool prints. The markdown table goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from moestream.bench.spec_section import KINDS, prompts_of  # noqa: E402
from moestream.cli import DEMO_DRAFT, DEMO_MODEL  # noqa: E402

DECODED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+s")
DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
ACCEPTED = re.compile(r"n_accept\s*=\s*(\d+)")


def tool_args(
    tool: str, bin_dir: Path, prompt: str, tokens: int, draft_max: int, ngl: int = 0
) -> list[str]:
    common = ["-m", str(DEMO_MODEL), "-p", prompt, "-n", str(tokens), "-t", "1", "--temp", "0"]
    common += ["--spec-draft-n-max", str(0 if tool == "plain" else draft_max), "-ngl", str(ngl)]
    if tool in ("plain", "lookup"):
        return [str(bin_dir / "llama-lookup"), *common]
    draft = ["-md", str(DEMO_DRAFT), "-td", "1", "-ngld", str(ngl)]
    return [str(bin_dir / "llama-speculative"), *common, *draft]


def run_tool(cmd: list[str]) -> dict[str, float]:
    """One run: decoded tokens and seconds, and drafted/accepted counts when printed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    text = out.stdout + out.stderr
    m = DECODED.search(text)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"{Path(cmd[0]).name} failed ({out.returncode}): {text[-400:]}")
    row = {"tokens": float(m.group(1)), "seconds": float(m.group(2))}
    for key, pattern in (("drafted", DRAFTED), ("accepted", ACCEPTED)):
        found = pattern.search(text)
        if found:
            row[key] = float(found.group(1))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bin_dir", type=Path)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--draft-max", type=int, default=4)
    parser.add_argument("--ngl", type=int, default=0, help="layers on the GPU (CUDA build)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    tools = ("plain", "lookup", "draft")
    result: dict[str, dict[str, list[dict[str, float]]]] = {}
    for kind in KINDS:
        prompts = prompts_of(kind, args.prompts)
        rounds: dict[str, list[dict[str, float]]] = {t: [] for t in tools}
        for r in range(args.rounds):
            order = tools[r % 3 :] + tools[: r % 3]
            for tool in order if r % 2 == 0 else tuple(reversed(order)):
                runs = [
                    run_tool(
                        tool_args(tool, args.bin_dir, p, args.tokens, args.draft_max, args.ngl)
                    )
                    for p in prompts
                ]
                total = {k: sum(x.get(k, 0.0) for x in runs) for k in runs[0]}
                rounds[tool].append(total)
        result[kind] = rounds
    print(
        "| prompts | llama.cpp | tok/s (median, min-max) | speedup over plain | accepted/drafted |"
    )
    print("|---|---|---|---|---|")
    for kind, rounds in result.items():
        plain = [x["tokens"] / x["seconds"] for x in rounds["plain"]]
        for tool in tools:
            rates = [x["tokens"] / x["seconds"] for x in rounds[tool]]
            speed = statistics.median(r / p for r, p in zip(rates, plain, strict=True))
            drafted = sum(x.get("drafted", 0.0) for x in rounds[tool])
            accepted = sum(x.get("accepted", 0.0) for x in rounds[tool])
            accept = f"{accepted / drafted:.0%}" if drafted else "-"
            print(
                f"| {kind} | {tool} | {statistics.median(rates):,.1f} ({min(rates):,.1f}-"
                f"{max(rates):,.1f}) | {speed:.2f}x | {accept} |"
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
