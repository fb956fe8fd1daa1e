"""The prompt set of the exactness gates (`eval --lossless`, `--determinism`, speculative modes).

Sixteen prompts: code to continue, prose, and copy-heavy text (repeated lines and tables) where
n-gram speculation and the prefix cache have the most to do. Several are longer than a few KV
blocks and than the 32-token prefill chunk of the chunked mode, so chunk boundaries and shared
blocks fall inside them; two pairs share a long prefix.
"""

from __future__ import annotations

_HEADER = '''"""Utilities for reading configuration files and validating their fields."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
'''

_TABLE = "\n".join(
    f"| {i:3d} | item-{i:03d} | {i * 7 % 13:2d} | {'yes' if i % 3 else 'no'} |" for i in range(12)
)

LOSSLESS_PROMPTS: tuple[str, ...] = (
    # code
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    _HEADER + "\n\n@dataclass\nclass Config:\n    name: str\n",
    _HEADER + "\n\ndef load(path: Path) -> dict:\n    ",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n    else:\n",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n",
    "    try:\n        value = int(text)\n    except ValueError:\n",
    # prose
    "The quick brown fox jumps over the lazy dog. The",
    "Once upon a time, in a small village by the sea, there lived",
    "Abstract. We describe a method for measuring the throughput of",
    "Q: What is the capital of France?\nA:",
    # copy-heavy
    "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny = 2\nx = 1\n",
    "| id | name | score | ok |\n|---|---|---|---|\n" + _TABLE + "\n|",
    ("assert f(1) == 1\nassert f(2) == 4\nassert f(3) == 9\nassert f(4) == 16\n" * 3)
    + "assert f(5) ==",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
)
