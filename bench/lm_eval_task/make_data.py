"""Write the two local lm-evaluation-harness datasets from moestream/data/heldout-python.txt.

    python bench/lm_eval_task/make_data.py [--out DIR]

- `heldout_python_ppl.jsonl`: {"text"}: top-level Python snippets (a def or class with what
  follows it up to the next one), for a `loglikelihood_rolling` perplexity task.
- `heldout_python_next_line.jsonl`: {"context", "choices", "label"}: the first lines of a
  snippet, the true next line and three lines drawn from other snippets, for a 4-way
  loglikelihood multiple-choice task.

The output is deterministic (a fixed seed, the file order), so the committed JSONL files are
exactly what this script writes; no Hugging Face hub access is needed to run the tasks.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HELDOUT = ROOT / "moestream" / "data" / "heldout-python.txt"
NUM_PPL = 12
NUM_CHOICE = 24
_START = re.compile(r"^(?:    )?(?:def |class |async def |@)")


def snippets(text: str, min_chars: int = 200, max_chars: int = 1200) -> list[str]:
    """Python snippets of `text` (documents separated by <|endoftext|>), each starting at a
    def, class or decorator at indentation 0 or 4, cut at the next one."""
    out = []
    for doc in text.split("<|endoftext|>"):
        current: list[str] = []
        for line in doc.splitlines():
            starts = _START.match(line) and not (current and _START.match(current[-1]))
            if starts and current:
                out.append("\n".join(current).strip("\n") + "\n")
                current = []
            current.append(line)
        if current:
            out.append("\n".join(current).strip("\n") + "\n")
    return [s for s in out if min_chars <= len(s) <= max_chars]


def _candidate_lines(snippet: str) -> list[int]:
    """Indices of lines worth predicting: not the first two, at least 16 characters."""
    lines = snippet.splitlines()
    return [i for i in range(2, len(lines)) if len(lines[i].strip()) >= 16]


def next_line_items(snips: list[str], count: int, rng: random.Random) -> list[dict]:
    """`count` multiple-choice items: context = the lines before a chosen line, choices = that
    line and three lines of other snippets (all with their newline)."""
    pool = [line for s in snips for i, line in enumerate(s.splitlines()) if len(line.strip()) >= 16]
    usable = [s for s in snips if _candidate_lines(s)]
    items = []
    for snippet in rng.sample(usable, min(count, len(usable))):
        lines = snippet.splitlines()
        k = rng.choice(_candidate_lines(snippet))
        answer = lines[k]
        distractors: list[str] = []
        while len(distractors) < 3:
            line = rng.choice(pool)
            if line not in lines and line not in distractors:
                distractors.append(line)
        label = rng.randrange(4)
        choices = distractors[:label] + [answer] + distractors[label:]
        context = "\n".join(lines[:k]) + "\n"
        items.append({"context": context, "choices": [c + "\n" for c in choices], "label": label})
    return items


def write(out: Path) -> list[Path]:
    rng = random.Random(0)
    snips = snippets(HELDOUT.read_text())
    ppl = [{"text": s} for s in snips[:: max(1, len(snips) // NUM_PPL)][:NUM_PPL]]
    choice = next_line_items(snips, NUM_CHOICE, rng)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in (("heldout_python_ppl", ppl), ("heldout_python_next_line", choice)):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    for path in write(p.parse_args().out):
        print(f"wrote {path} ({sum(1 for _ in path.open())} rows)")


if __name__ == "__main__":
    main()
