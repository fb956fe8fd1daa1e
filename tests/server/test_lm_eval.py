"""lm-evaluation-harness `local-completions` runs unchanged against the server (optional extra
`lm-eval[api]`; skipped without it): the two local tasks of bench/lm_eval_task/ go through
/tokenize, /detokenize, /tokenizer_info and /v1/completions with echo + prompt logprobs, and
every loglikelihood lm-eval records equals the model's own, computed in-process."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TASK_DIR = ROOT / "bench" / "lm_eval_task"
MODEL = "tiny"  # conftest's served name
MAX_LENGTH = 64  # lm-eval's window: short, so documents span several
LIMIT = 3  # documents per task

_MISSING = [m for m in ("lm_eval", "tenacity", "aiohttp") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(
    bool(_MISSING),
    reason=f"optional lm-eval extra not installed (missing {', '.join(_MISSING)}): "
    "pip install 'lm-eval[api]>=0.4'",
)


# lm-eval's own entry point with only our task folder indexed. The CLI (bench/lm_eval_demo.sh)
# runs the same model class and tasks but first indexes lm-eval's thousands of built-in task
# files: 14 s against 4 s for a one-document run with the dummy model on this machine.
_RUNNER = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from lm_eval.utils import make_table
url, model, tasks_dir, tasks, limit, max_length, out = sys.argv[1:]
results = simple_evaluate(
    model="local-completions",
    model_args=(f"model={model},base_url={url}/v1/completions,tokenizer_backend=remote,"
                f"num_concurrent=1,max_retries=1,max_length={max_length}"),
    tasks=tasks.split(","), limit=int(limit), log_samples=True,
    task_manager=TaskManager(include_path=tasks_dir, include_defaults=False),
)
print(make_table(results))
with open(out, "w") as f:
    json.dump({"results": results["results"], "samples": results["samples"]}, f, default=str)
"""


def _run_lm_eval(url: str, out: Path) -> tuple[subprocess.CompletedProcess, dict]:
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(out / "hf-cache"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    tasks = "heldout_python_ppl,heldout_python_next_line"
    args = [url, MODEL, str(TASK_DIR), tasks, str(LIMIT), str(MAX_LENGTH), str(out / "res.json")]
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, json.loads((out / "res.json").read_text())


def _continuation_logprob(llm, context: list[int], continuation: list[int]) -> float:
    """log p(continuation | context) from the model in-process (float32 logits)."""
    ids = context + continuation
    logp = torch.log_softmax(llm.logits(ids), dim=-1)  # [T, V]
    start = len(context)
    return sum(logp[start - 1 + i, t].item() for i, t in enumerate(continuation))


def _encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's causal split: trailing whitespace of the context moves to the continuation,
    the whole is encoded once and cut after the context's tokens; the context is then cut on
    the left so that both fit in MAX_LENGTH - 1 tokens."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    cont = whole[len(ctx) :]
    return whole[-(MAX_LENGTH - 1) : -len(cont)], cont


def test_lm_eval_local_completions(app_factory, live_server, llm, tmp_path):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    with live_server(app_factory()) as live:
        proc, out = _run_lm_eval(live.url, tmp_path)
    # The server has stopped: its engine thread no longer owns the model.
    assert "heldout_python_ppl" in proc.stdout and "bits_per_byte" in proc.stdout
    results, samples = out["results"], out["samples"]
    assert 0.0 <= results["heldout_python_next_line"]["acc,none"] <= 1.0
    assert results["heldout_python_ppl"]["bits_per_byte,none"] > 0

    tok = llm.tokenizer
    eos = min(tok.eos_token_ids)  # lm-eval's prefix token: /tokenizer_info's eos, tokenized
    ppl = samples["heldout_python_ppl"]
    assert len(ppl) == LIMIT
    windows_seen = 0
    for sample in ppl:
        ids = tok.encode(sample["doc"]["text"], add_special_tokens=False)
        windows = [
            make_disjoint_window(w)
            for w in get_rolling_token_windows(ids, eos, MAX_LENGTH - 2, context_len=1)
        ]
        windows_seen += len(windows)
        expected = sum(_continuation_logprob(llm, c, p) for c, p in windows)
        assert float(sample["filtered_resps"][0]) == pytest.approx(expected, rel=1e-4, abs=1e-3)
    assert windows_seen > LIMIT  # some documents spanned several rolling windows

    choice = samples["heldout_python_next_line"]
    assert len(choice) == LIMIT
    for sample in choice:
        assert len(sample["arguments"]) == len(sample["doc"]["choices"]) == 4
        for (context, continuation), (loglikelihood, _) in zip(
            sample["arguments"], sample["filtered_resps"]
        ):
            expected = _continuation_logprob(llm, *_encode_pair(tok, context, continuation))
            assert float(loglikelihood) == pytest.approx(expected, rel=1e-4, abs=1e-3)
