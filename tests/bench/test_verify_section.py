"""`moestream bench --verify-curve`: the cost of an engine step that feeds k tokens per request.

Runs on the embedded demo model (CPU, one thread) with tiny prompts. The step times are not
checked; what is checked is that each timed step really fed b requests x k tokens through the
engine's verify path, and the shape and arithmetic of the result.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from moestream.bench.report import format_markdown
from moestream.bench.runner import BenchConfig, result_metrics, run_bench
from moestream.bench.verify_section import FORMULA, VerifyCostSection, implied_speedup
from moestream.cli import DEMO_MODEL, main
from moestream.errors import RequestError
from moestream.llm import LLM

SECTIONS = (VerifyCostSection(),)


def _config(**kw) -> BenchConfig:
    base = {"repeats": 1, "warmup": 0, "copy_bandwidth_gbps": 10.0, "concurrency_prompt": 8}
    return BenchConfig(**{**base, **kw})


def test_verify_curve_through_the_engine() -> None:
    llm = LLM(
        DEMO_MODEL,
        device="cpu",
        num_threads=1,
        speculative="ngram",
        max_num_seqs=3,
        max_num_batched_tokens=8,
    )
    engine = llm.engine
    spec = engine.speculator
    fed: list[tuple[int, tuple[int, ...]]] = []  # decode steps: (requests, drafts of each)
    execute = engine.runner.execute

    ahead: set[bool] = set()  # run-ahead during the decode steps

    def spy(plan):
        if plan.scheduled and all(s.is_decode for s in plan.scheduled):
            fed.append((len(plan.scheduled), tuple(len(s.draft_token_ids) for s in plan.scheduled)))
            ahead.add(engine.runner.run_ahead)
        return execute(plan)

    engine.runner.execute = spy
    engine.runner.run_ahead = True
    config = _config(verify_ks=(2, 4), verify_batches=(1, 2, 3), verify_tau=(2.0, 3.5, 5.0))
    r = run_bench(llm, config, sections=SECTIONS)
    assert engine.speculator is spec and not engine.has_unfinished()
    # a timed plain step must not queue the next one (its timing would include it)
    assert ahead == {False}

    data = r["verify_cost"]
    assert data["depth"] == 8 and data["ks"] == [1, 2, 4] and data["formula"] == FORMULA
    cells = [(row["batch"], row["k"]) for row in data["rows"]]
    # b=3 x k=4 = 12 tokens exceeds the step budget of 8: skipped with its reason.
    assert cells == [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (3, 1), (3, 2)]
    assert r["skipped"] == [
        {"section": "verify_cost", "tokens": 3, "reason": r["skipped"][0]["reason"]}
    ]
    assert "--max-num-batched-tokens 8" in r["skipped"][0]["reason"]
    for b, k in cells:  # each timed step fed b requests with k - 1 drafts each
        assert (b, (k - 1,) * b) in fed
    for row in data["rows"]:
        assert row["drafts_per_request"] == row["k"] - 1
        assert row["tokens_per_step"] == row["batch"] * row["k"]
        assert row["cuda_graph"] is False  # CPU
        s = row["step_ms"]
        assert 0 < s["min"] <= s["median"] <= s["max"] and s["n"] == 1
        base = next(x for x in data["rows"] if x["batch"] == row["batch"] and x["k"] == 1)
        assert math.isfinite(row["cost_ratio"]) and row["cost_ratio"] > 0
        assert row["cost_ratio"] == pytest.approx(s["median"] / base["step_ms"]["median"])
        if row["k"] == 1:
            assert row["cost_ratio"] == 1.0
    speedup = {(x["batch"], x["tau"]): x for x in data["speedup"]}
    assert len(speedup) == 9
    for (b, tau), x in speedup.items():
        ratios = {row["k"]: row["cost_ratio"] for row in data["rows"] if row["batch"] == b}
        if tau > max(ratios):  # tau 5 with k <= 4; tau 3.5 at b=3 (k <= 2)
            assert x["speedup"] is None and x["best_k"] is None
        else:
            assert x["best_k"] >= tau
            assert x["speedup"] == pytest.approx(tau / ratios[x["best_k"]])
            assert x["speedup"] == max(tau / c for k, c in ratios.items() if k >= tau)
    assert speedup[(3, 3.5)]["speedup"] is None and speedup[(1, 3.5)]["best_k"] == 4

    md = format_markdown(r, sections=SECTIONS)
    assert "## verify_cost" in md and FORMULA in md and "speedup tau=3.5 (k)" in md
    assert "| 3 | 1.00x (" in md  # the batch of 3 has no k=4 cell
    names = [m.name for m in result_metrics(r, SECTIONS)]
    assert names[:3] == ["verify b1 k1 step ms", "verify b1 k2 step ms", "verify b1 k4 step ms"]


def test_verify_curve_skips_batches_over_max_num_seqs() -> None:
    llm = LLM(DEMO_MODEL, device="cpu", num_threads=1, max_num_seqs=1)
    r = run_bench(llm, _config(verify_ks=(2,), verify_batches=(1, 2)), sections=SECTIONS)
    assert [row["batch"] for row in r["verify_cost"]["rows"]] == [1, 1]
    assert "--max-num-seqs 1" in r["skipped"][0]["reason"]


def test_implied_speedup() -> None:
    ratios = {1: 1.0, 2: 1.1, 4: 1.5, 8: 3.0}
    assert implied_speedup(ratios, 3.0) == (2.0, 4)  # k=4: 3 / 1.5; k=8: 3 / 3
    assert implied_speedup(ratios, 2.0) == pytest.approx((2 / 1.1, 2))
    assert implied_speedup(ratios, 1.0) == (1.0, 1)
    assert implied_speedup(ratios, 9.0) is None


def test_cli_flags(tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["bench", str(DEMO_MODEL), "--device", "cpu", "--threads", "1", "--prompt-lens", "8"]
    argv += ["--decode-depths", "0", "--decode-tokens", "2", "--repeats", "1", "--warmup", "0"]
    argv += ["--copy-bandwidth", "10", "--concurrency-prompt", "8", "--verify-curve", "2"]
    argv += ["--verify-batches", "2", "--verify-tau", "1.5", "--out", str(out)]
    assert main(argv) == 0
    r = json.loads((out / "result.json").read_text())
    cfg = r["config"]
    assert cfg["verify_ks"] == [2] and cfg["verify_batches"] == [2] and cfg["verify_tau"] == [1.5]
    assert [(row["batch"], row["k"]) for row in r["verify_cost"]["rows"]] == [(2, 1), (2, 2)]
    assert [x["tau"] for x in r["verify_cost"]["speedup"]] == [1.5]
    assert "## verify_cost" in (out / "result.md").read_text()


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--verify-curve", "0,2"),
        ("--verify-curve", "1,x"),
        ("--verify-batches", "0"),
        ("--verify-tau", "0.5"),
    ],
)
def test_bad_flag_values(flag: str, value: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", str(DEMO_MODEL), flag, value])
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_config_validation() -> None:
    with pytest.raises(RequestError, match="--verify-curve"):
        BenchConfig(verify_ks=(0,))
    with pytest.raises(RequestError, match="--verify-tau"):
        BenchConfig(verify_tau=(0.5,))
