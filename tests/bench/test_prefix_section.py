"""`moestream bench --prefix-reuse LEN[:SHARED]`: cold vs warm time to first token.

Runs on the embedded demo model (CPU, one thread) with a tiny LEN; the times are not checked,
only the shape of the result and the cached-token counts the engine reports.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from moestream.bench.cli import _child_argv
from moestream.bench.prefix_section import PrefixReuseSection, expected_cached_tokens
from moestream.bench.report import format_markdown
from moestream.bench.runner import BenchConfig, result_metrics, run_bench
from moestream.cli import DEMO_MODEL, build_parser, main
from moestream.errors import RequestError
from moestream.llm import LLM

SECTIONS = (PrefixReuseSection(),)


def _config(**kw) -> BenchConfig:
    base = {"repeats": 2, "warmup": 0, "copy_bandwidth_gbps": 10.0, "prompt_lens": ()}
    return BenchConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(DEMO_MODEL, device="cpu", num_threads=1)


def test_prefix_reuse_cold_and_warm(llm: LLM) -> None:
    r = run_bench(llm, _config(prefix_reuse=(96, 64)), sections=SECTIONS)
    data = r["prefix_reuse"]
    assert data["prompt_tokens"] == 96 and data["shared_tokens"] == 64
    assert data["block_size"] == 16 and data["prefix_caching"] is True
    assert data["expected_cached_tokens"] == 64
    cold, warm = data["rows"]
    assert (cold["prompt"], warm["prompt"]) == ("cold", "warm")
    assert cold["cached_tokens"] == 0  # a fresh random prompt: nothing to reuse
    assert warm["cached_tokens"] >= 64  # every whole block of the shared prefix
    assert len(data["samples"]) == 2
    for s in data["samples"]:
        assert s["cold_cached_tokens"] == 0 and s["warm_cached_tokens"] >= 64
        assert s["warm_over_cold"] == pytest.approx(s["warm_s"] / s["cold_s"])
    for row in (cold, warm):
        t = row["ttft_s"]
        assert 0 < t["min"] <= t["median"] <= t["max"] and t["n"] == 2
    ratio = data["warm_over_cold"]
    assert math.isfinite(ratio) and ratio == pytest.approx(
        warm["ttft_s"]["median"] / cold["ttft_s"]["median"]
    )
    md = format_markdown(r, sections=SECTIONS)
    assert "## prefix_reuse" in md and "| warm | 96 | 64 |" in md
    names = [m.name for m in result_metrics(r, SECTIONS)]
    assert names == ["prefix 96 cold TTFT s", "prefix 96 warm TTFT s", "prefix 96 warm/cold"]


def test_prefix_reuse_rounds_shared_down_to_blocks(llm: LLM) -> None:
    logged: list[str] = []
    r = run_bench(llm, _config(prefix_reuse=(64, 40), repeats=1), sections=SECTIONS,
                  log=logged.append)  # fmt: skip
    data = r["prefix_reuse"]
    assert data["expected_cached_tokens"] == 32
    assert data["rows"][1]["cached_tokens"] == 32  # 40 shared tokens: two whole blocks
    # each section's table is logged when it ends, as the report will show it
    assert logged[0] == "bench: prefix_reuse ..." and len(logged) == 2
    table = logged[1].splitlines()
    assert table[0] == "## prefix_reuse" and "| warm | 64 | 40 |" in logged[1]
    assert "\n".join(table[2:-1]) in format_markdown(r, sections=SECTIONS)


def test_prefix_reuse_without_prefix_caching() -> None:
    llm = LLM(DEMO_MODEL, device="cpu", num_threads=1, enable_prefix_caching=False)
    data = run_bench(llm, _config(prefix_reuse=(48, 32), repeats=1), sections=SECTIONS)
    data = data["prefix_reuse"]
    assert data["prefix_caching"] is False and data["expected_cached_tokens"] == 0
    assert [row["cached_tokens"] for row in data["rows"]] == [0, 0]


def test_prefix_reuse_skips_what_does_not_fit() -> None:
    llm = LLM(DEMO_MODEL, device="cpu", num_threads=1, max_model_len=64)
    r = run_bench(llm, _config(prefix_reuse=(96, 64)), sections=SECTIONS)
    assert "prefix_reuse" not in r
    assert r["skipped"] == [
        {"section": "prefix_reuse", "tokens": 96, "reason": r["skipped"][0]["reason"]}
    ]
    assert "max_model_len 64" in r["skipped"][0]["reason"]
    small = LLM(DEMO_MODEL, device="cpu", num_threads=1, kv_cache_gib=2e-4, max_model_len=64)
    r = run_bench(small, _config(prefix_reuse=(60, 40)), sections=SECTIONS)
    assert "prefix_reuse" not in r and "KV blocks" in r["skipped"][0]["reason"]


def test_expected_cached_tokens() -> None:
    assert expected_cached_tokens(32768, 31744, 16) == 31744
    assert expected_cached_tokens(100, 50, 16) == 48
    assert expected_cached_tokens(64, 63, 16) == 48  # the last token is always computed
    assert expected_cached_tokens(64, 10, 16) == 0


def test_cli_flag(tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["bench", str(DEMO_MODEL), "--device", "cpu", "--threads", "1", "--prompt-lens", "8"]
    argv += ["--decode-depths", "0", "--decode-tokens", "2", "--repeats", "1", "--warmup", "0"]
    argv += ["--copy-bandwidth", "10", "--prefix-reuse", "48:32", "--out", str(out)]
    assert main(argv) == 0
    r = json.loads((out / "result.json").read_text())
    assert r["config"]["prefix_reuse"] == [48, 32]
    assert r["prefix_reuse"]["rows"][1]["cached_tokens"] == 32
    assert "## prefix_reuse" in (out / "result.md").read_text()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("96:96", "1 <= SHARED < LEN"),
        ("96:100", "1 <= SHARED < LEN"),
        ("96:0", "1 <= SHARED < LEN"),
        ("512", "LEN - 1024"),
        ("x:3", "LEN[:SHARED]"),
    ],
)
def test_bad_flag_values(value: str, message: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", str(DEMO_MODEL), "--prefix-reuse", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--prefix-reuse" in err and message in err


def test_flag_parsing_and_compare_children() -> None:
    args = build_parser().parse_args(["bench", "m.gguf", "--prefix-reuse", "32k"])
    assert args.prefix_reuse == (32768, 31744)
    args = build_parser().parse_args(["bench", "m.gguf", "--prefix-reuse", "32k:31k"])
    assert args.prefix_reuse == (32768, 31744)
    child = _child_argv(args)
    assert child[child.index("--prefix-reuse") + 1] == "32768:31744"
    assert "--concurrency" not in child  # an empty sweep is not passed on
    with pytest.raises(RequestError, match="SHARED < LEN"):
        BenchConfig(prefix_reuse=(16, 16))
