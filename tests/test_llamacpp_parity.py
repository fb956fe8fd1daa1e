"""The demo GGUF written by `moestream convert` loads in llama.cpp and gives the same predictions.

Optional: needs `llama-cpp-python` (pip install -e '.[llamacpp]', which builds llama.cpp from its
PyPI source in a few minutes). llama.cpp's CPU path quantizes activations to 8 bits inside its
matmuls, so logits agree closely but not bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]')"
)

from moestream import LLM  # noqa: E402
from moestream.cli import DEMO_MODEL  # noqa: E402

HELDOUT = Path(__file__).parents[1] / "moestream" / "data" / "heldout-python.txt"


@pytest.mark.llamacpp
def test_demo_gguf_matches_llamacpp():
    text = HELDOUT.read_text()[:4000]
    llm = LLM(DEMO_MODEL)
    ref = llama_cpp.Llama(
        str(DEMO_MODEL), n_ctx=512, logits_all=True, verbose=False, n_threads=2, seed=0
    )
    ids = llm.tokenizer.encode(text)[:256]
    assert ids == ref.tokenize(text.encode(), add_bos=False, special=True)[:256]
    ref.reset()
    ref.eval(ids)
    ref_logits = torch.tensor(np.array(ref.scores[: len(ids)], dtype=np.float32))  # [T, V]
    ours = llm.logits(ids)  # [T, V]
    top1 = (ref_logits.argmax(-1) == ours.argmax(-1)).float().mean().item()
    lr, lo = ref_logits.log_softmax(-1), ours.log_softmax(-1)
    kl = (lr.exp() * (lr - lo)).sum(-1).mean().item()
    # Measured 2026-11-29 (llama-cpp-python 0.3.36, CPU): top-1 0.977, mean KL 0.0018.
    assert top1 >= 0.95, top1
    assert kl <= 0.01, kl
