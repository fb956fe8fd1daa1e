"""`moestream eval`: the logits gate passes for a model against itself and fails for a perturbed
copy; the exactness gates pass on a tiny model and catch a mode that changes a token; the llama.cpp
reference is skipped with a clear message when llama-cpp-python is absent.

Models are tiny random Qwen3-MoE folders made on the fly (vocab 4096, to fit the fixture
tokenizer), with weights drawn N(0, 1/fan_in) so that logits are peaked and top-1 is meaningful.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from moestream.cli import main
from moestream.eval.logits_eval import evaluate_logits, windows
from moestream.eval.lossless import MODES, Mode, ModeRun, all_together, run_lossless
from moestream.eval.prompts import LOSSLESS_PROMPTS

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VOCAB = 4096


def _save_tiny(path: Path, seed: int) -> None:
    import transformers as tf

    config = tf.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,  # as real Qwen3-MoE (llama.cpp always renormalises top-k)
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    model = tf.Qwen3MoeForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))
    model.save_pretrained(path)
    for f in FIXTURES.glob("tokenizer*.json"):
        shutil.copy(f, path)


def _perturb(src: Path, dst: Path, rel: float) -> None:
    """A copy of `src` with Gaussian noise of `rel` times each matrix's std added."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(123)
    for name, t in tensors.items():
        if t.ndim >= 2:
            tensors[name] = t + rel * t.std() * torch.randn(t.shape, generator=g)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("models")
    _save_tiny(base / "ours", seed=0)
    _perturb(base / "ours", base / "perturbed", rel=0.5)
    return base / "ours", base / "perturbed"


def _eval(model: Path, ref: Path, tmp_path: Path) -> tuple[int, dict]:
    report = tmp_path / "eval.json"
    rc = main(
        [
            "eval",
            str(model),
            "--reference",
            str(ref),
            "--ctx",
            "64",
            "--max-text-tokens",
            "256",
            "--json",
            str(report),
        ]
    )
    return rc, json.loads(report.read_text())


def test_identical_model_passes(models, tmp_path: Path) -> None:
    ours, _ = models
    rc, report = _eval(ours, ours, tmp_path)
    r = report["reference"]
    assert rc == 0 and report["passed"] and r["status"] == "passed"
    assert r["n_windows"] == 4 and r["n_positions"] == 256 and r["n_predictions"] == 252
    assert r["top1"] == 1.0
    assert r["kl_mean"] < 1e-6
    assert r["ppl_ours"] == pytest.approx(r["ppl_ref"], rel=1e-4)
    assert 1.0 < r["ppl_ours"] < 1e6
    assert "heldout-python.txt" in r["text"]  # the bundled default text


def test_perturbed_model_fails(models, tmp_path: Path, capsys) -> None:
    ours, perturbed = models
    rc, report = _eval(perturbed, ours, tmp_path)
    r = report["reference"]
    assert rc == 1 and not report["passed"] and r["status"] == "failed"
    assert not (r["top1_ok"] and r["kl_ok"])
    assert r["kl_mean"] > 0.1
    assert "logits gate: FAIL" in capsys.readouterr().out


def test_gate_bars_are_configurable(models, tmp_path: Path) -> None:
    ours, perturbed = models
    report = tmp_path / "eval.json"
    rc = main(
        [
            "eval",
            str(perturbed),
            "--reference",
            str(ours),
            "--ctx",
            "64",
            "--max-text-tokens",
            "128",
            "--min-top1",
            "0",
            "--max-kl",
            "1000",
            "--json",
            str(report),
        ]
    )
    assert rc == 0 and json.loads(report.read_text())["reference"]["passed"]


def test_lossless_and_determinism_pass(models, tmp_path: Path) -> None:
    ours, _ = models
    report = tmp_path / "exact.json"
    rc = main(
        [
            "eval",
            str(ours),
            "--lossless",
            "--determinism",
            "2",
            "--num-prompts",
            "5",  # prompts 3 and 4 span several KV blocks and 32-token chunks
            "--gen-tokens",
            "5",
            "--json",
            str(report),
        ]
    )
    r = json.loads(report.read_text())
    assert rc == 0 and r["passed"]
    assert [m["mode"] for m in r["lossless"]["modes"]] == [m.name for m in MODES]
    for m in r["lossless"]["modes"]:
        assert m["passed"] and m["identical"] == m["total"] == 5 and not m["mismatches"]
    cache = next(m for m in r["lossless"]["modes"] if m["mode"] == "prefix-cache")
    assert cache["cached_tokens"] > 0
    assert r["determinism"]["runs"] == 2 and r["determinism"]["passed"]


def test_lossless_catches_a_changed_token(models) -> None:
    ours, _ = models

    def off_by_one(llm, prompts, params) -> ModeRun:
        run = all_together(llm, prompts, params)
        run.outputs[1] = run.outputs[1][:2] + [(run.outputs[1][2] + 1) % VOCAB] + run.outputs[1][3:]
        return run

    bad = Mode("broken", "changes the third token of prompt 1", off_by_one)
    r = run_lossless(ours, {}, LOSSLESS_PROMPTS[:3], max_tokens=4, modes=(bad,))
    assert not r["passed"]
    (mode,) = r["modes"]
    assert mode["identical"] == 2 and mode["total"] == 3
    assert mode["mismatches"][0]["prompt"] == 1 and mode["mismatches"][0]["position"] == 2


def test_llamacpp_reference_skipped_without_package(
    models, tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if it were not installed
    ours, _ = models
    gguf = tmp_path / "ref.gguf"
    gguf.write_bytes(b"GGUF")
    report = tmp_path / "eval.json"
    rc = main(["eval", str(ours), "--reference", str(gguf), "--json", str(report)])
    assert rc == 0
    r = json.loads(report.read_text())["reference"]
    assert r["status"] == "skipped" and "llama-cpp-python" in r["reason"]
    assert "reference skipped" in capsys.readouterr().err


@pytest.mark.llamacpp
def test_llamacpp_reference_on_same_gguf(models, tmp_path: Path) -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install 'moestream[llamacpp]')")
    from moestream.weights.convert import convert

    ours, _ = models
    gguf = convert(ours, tmp_path / "tiny-F32.gguf", quant="F32", progress=False)
    report = tmp_path / "eval.json"
    rc = main(
        [
            "eval",
            str(gguf),
            "--reference",
            str(gguf),
            "--ctx",
            "64",
            "--max-text-tokens",
            "256",
            "--json",
            str(report),
        ]
    )
    r = json.loads(report.read_text())["reference"]
    assert rc == 0 and r["status"] == "passed" and r["reference"].startswith("llama.cpp")
    assert r["top1"] >= 0.99 and r["kl_mean"] < 1e-3


def test_eval_needs_a_gate(models) -> None:
    ours, _ = models
    assert main(["eval", str(ours)]) == 2


def test_metrics_on_synthetic_logits() -> None:
    g = torch.Generator().manual_seed(0)
    table = torch.randn(11, 11, generator=g) * 3  # a bigram model: logits [V, V]
    ids = torch.randint(0, 11, (50,), generator=g).tolist()

    def ref(x):
        return table[x]  # [T, V]

    same = evaluate_logits(ref, ref, ids, ctx=20)
    assert same.top1 == 1.0 and same.kl_mean == pytest.approx(0.0, abs=1e-12) and same.passed
    assert same.n_windows == 3 and same.n_positions == 50 and same.n_predictions == 47
    uniform = evaluate_logits(lambda x: torch.zeros(len(x), 11), ref, ids, ctx=20)
    assert uniform.ppl_ours == pytest.approx(11.0)
    assert not uniform.passed
    # KL(ref || uniform) = log V - H(ref), row by row
    logp = torch.log_softmax(table[ids].double(), -1)
    want = (math.log(11) + (logp.exp() * logp).sum(-1)).mean().item()
    assert uniform.kl_mean == pytest.approx(want, rel=1e-9)
    # perplexity of the reference over the in-window next tokens
    nll = [-logp[i, ids[i + 1]].item() for s, e in windows(50, 20) for i in range(s, e - 1)]
    assert uniform.ppl_ref == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-9)
    assert windows(10, 4) == [(0, 4), (4, 8), (8, 10)] and windows(9, 4) == [(0, 4), (4, 8)]
