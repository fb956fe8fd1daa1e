"""`moestream bench`: result schema of a tiny CPU run, the A/B noise verdict, power sampling.

The model is a tiny random Qwen3-MoE made on the fly with transformers (vocab 4096, to fit the
fixture tokenizer); the figures it measures are not checked, only their shape and consistency.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest

from moestream.bench.compare import (
    COMPARE_SCHEMA,
    compare_results,
    interleaved_order,
    sides_from_args,
    spread,
    verdict,
)
from moestream.bench.machine import git_info, machine_info
from moestream.bench.power import PowerSampler, open_power_sampler
from moestream.bench.report import format_markdown, write_report
from moestream.bench.runner import SCHEMA, measure_copy_bandwidth, result_metrics
from moestream.cli import main
from moestream.errors import RequestError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    import torch
    import transformers as tf

    path = tmp_path_factory.mktemp("tiny-moe")
    config = tf.Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    tf.Qwen3MoeForCausalLM(config).save_pretrained(path)
    for f in FIXTURES.glob("tokenizer*.json"):
        shutil.copy(f, path)
    return path


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _check_stats(s: dict) -> None:
    assert set(s) == {"median", "min", "max", "n"}
    assert 0 < s["min"] <= s["median"] <= s["max"]


def test_bench_run_schema(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    rc = main(
        [
            "bench",
            str(tiny_model),
            "--prompt-lens",
            "16,32,100",
            "--decode-depths",
            "0,16",
            "--decode-tokens",
            "4",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--max-model-len",
            "64",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    r = json.loads((out / "result.json").read_text())
    assert r["schema"] == SCHEMA
    for key in (
        "run",
        "machine",
        "git",
        "model",
        "config",
        "copy_bandwidth",
        "power",
        "memory",
        "skipped",
        "prefill",
        "decode",
    ):
        assert key in r, key
    # Later sections appear only when they ran: no empty placeholders.
    assert not {"concurrency", "speculative", "experts"} & set(r)
    assert r["machine"]["device"] == "cpu" and r["machine"]["gpu"] is None
    assert isinstance(r["machine"]["cpu_cores_logical"], int)
    assert "bench" in r["run"]["command"] and r["run"]["date"]
    assert r["config"]["temperature"] == 0.0
    assert "(greedy)" in format_markdown(r)
    assert r["config"]["repeats"] == 2 and r["config"]["seed"] == 0
    assert r["config"]["engine"]["max_model_len"] == 64
    assert r["copy_bandwidth"]["source"] == "measured" and r["copy_bandwidth"]["gbps"] > 0
    assert r["power"] == {"available": False, "reason": r["power"]["reason"]}
    assert "cpu" in r["power"]["reason"]
    m = r["model"]
    assert m["architecture"] == "qwen3moe" and m["max_model_len"] == 64
    # 2 layers x 1 KV head x 16 dims x K and V x float32
    assert m["kv_bytes_per_token"] == 2 * 2 * 1 * 16 * 4
    assert m["weight_bytes_per_token"] > 0

    prefill = r["prefill"]["rows"]
    assert [row["prompt_tokens"] for row in prefill] == [16, 32]
    assert r["skipped"] == [
        {"section": "prefill", "tokens": 100, "reason": r["skipped"][0]["reason"]}
    ]
    for row in prefill:
        assert len(row["samples"]) == 2
        _check_stats(row["tok_s"])
        _check_stats(row["seconds"])
        for s in row["samples"]:
            assert s["tok_s"] == pytest.approx(row["prompt_tokens"] / s["seconds"])
            assert s["power"] is None and s["gpu_peak_bytes"] is None
        assert row["mean_power_w"] is None and row["j_per_prompt_token"] is None

    decode = r["decode"]["rows"]
    assert [row["depth"] for row in decode] == [0, 16]
    for row in decode:
        assert row["decode_tokens"] == 4
        assert [s["tokens"] for s in row["samples"]] == [4, 4]
        _check_stats(row["tok_s"])
        expect = m["weight_bytes_per_token"] + m["kv_bytes_per_token"] * (max(row["depth"], 1) + 2)
        assert row["bytes_per_token"] == int(expect)
        ceiling = r["copy_bandwidth"]["gbps"] * 1e9 / expect
        assert row["ceiling_tok_s"] == pytest.approx(ceiling)
        assert row["pct_of_ceiling"] == pytest.approx(100 * row["tok_s"]["median"] / ceiling)
    assert r["memory"]["host_peak_rss_bytes"] > 0 and r["memory"]["gpu_peak_bytes"] is None

    md = (out / "result.md").read_text()
    assert "## prefill" in md and "## decode" in md and "| 32 |" in md
    assert "prefill 100" in md  # the skipped row is stated
    assert _is_png(out / "result.png")
    names = [x.name for x in result_metrics(r)]
    assert names == ["prefill 16 tok/s", "prefill 32 tok/s", "decode @0 tok/s", "decode @16 tok/s"]


def test_compare_children_interleaved(tiny_model: Path, tmp_path: Path) -> None:
    # Side A: this checkout; side B: a copy of the package, which its child must import.
    import moestream.cli

    here = Path(moestream.cli.__file__).resolve().parents[1]
    copy = tmp_path / "checkout-b"
    shutil.copytree(
        here / "moestream",
        copy / "moestream",
        ignore=shutil.ignore_patterns("*.gguf", "__pycache__"),
    )
    out = tmp_path / "cmp"
    rc = main(
        [
            "bench",
            str(tiny_model),
            "--prompt-lens",
            "16",
            "--decode-depths",
            "0",
            "--decode-tokens",
            "2",
            "--repeats",
            "2",
            "--warmup",
            "0",
            "--copy-bandwidth",
            "10",
            "--compare",
            "--max-num-batched-tokens 2048",
            "--max-num-batched-tokens 8",
            "--compare-checkouts",
            str(here),
            str(copy),
            "--rounds",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    r = json.loads((out / "result.json").read_text())
    assert r["schema"] == COMPARE_SCHEMA
    assert r["order"] == ["A", "B"]
    assert [run["side"] for run in r["runs"]] == ["A", "B"]
    assert [run["git"]["path"] for run in r["runs"]] == [str(here), str(copy)]
    assert "--max-num-batched-tokens 8" in r["runs"][1]["command"]
    assert r["results"]["B"][0]["config"]["engine"]["max_num_batched_tokens"] == 8
    assert r["results"]["A"][0]["copy_bandwidth"] == {
        "gbps": 10.0,
        "source": "given",
        "counts": "bytes read + written",
    }
    metrics = {m["metric"]: m for m in r["metrics"]}
    assert set(metrics) == {"prefill 16 tok/s", "decode @0 tok/s"}
    for m in metrics.values():
        assert len(m["a"]) == len(m["b"]) == 2
        assert m["verdict"] in ("noise", "faster", "slower")
    assert "B/A" in (out / "result.md").read_text()
    assert _is_png(out / "result.png")


def test_verdict_noise_and_differences() -> None:
    assert spread([90, 100, 110]) == pytest.approx(0.2)
    same = verdict([100, 102, 98], [101, 99, 103])
    assert same["verdict"] == "noise" and same["ratio"] == pytest.approx(1.01)
    assert verdict([100, 101, 99], [120, 121, 119])["verdict"] == "faster"
    assert verdict([100, 101, 99], [80, 81, 79])["verdict"] == "slower"
    # 15% better, but A alone spreads over 20%: noise, not a gain.
    wide = verdict([90, 110, 100], [115, 116, 114])
    assert wide["ratio"] == pytest.approx(1.15) and wide["verdict"] == "noise"
    # Lower is better (J/token).
    assert (
        verdict([1.0, 1.01, 0.99], [0.8, 0.81, 0.79], higher_is_better=False)["verdict"] == "better"
    )
    assert (
        verdict([1.0, 1.01, 0.99], [1.2, 1.21, 1.19], higher_is_better=False)["verdict"] == "worse"
    )
    assert verdict([100], [200])["verdict"] == "too few samples"


def test_interleaving_and_sides(tmp_path: Path) -> None:
    assert interleaved_order(3) == ["A", "B", "B", "A", "A", "B"]
    assert interleaved_order(4)[-2:] == ["B", "A"]
    with pytest.raises(RequestError):
        interleaved_order(0)
    a, b = sides_from_args(["--dtype float16", ""], None)
    assert a.args == ("--dtype", "float16") and b.args == () and a.checkout is None
    with pytest.raises(RequestError, match="moestream/__init__.py"):
        sides_from_args(None, [str(tmp_path), str(tmp_path)])
    checkout = tmp_path / "co"
    (checkout / "moestream").mkdir(parents=True)
    (checkout / "moestream" / "__init__.py").write_text("")
    a, _ = sides_from_args(None, [str(checkout), str(checkout)])
    assert a.env()["PYTHONPATH"].split(":")[0] == str(checkout.resolve())


def _fake_result(prefill: list[float], decode: list[float]) -> dict:
    return {
        "prefill": {
            "rows": [
                {
                    "prompt_tokens": 512,
                    "j_per_prompt_token": None,
                    "samples": [{"tok_s": x, "power": None} for x in prefill],
                }
            ]
        },
        "decode": {
            "rows": [
                {
                    "depth": 0,
                    "decode_tokens": 8,
                    "j_per_generated_token": 0.5,
                    "samples": [{"tok_s": x, "power": {"energy_j": 4.0}} for x in decode],
                }
            ]
        },
    }


def test_compare_pools_children_and_reports(tmp_path: Path) -> None:
    a = [_fake_result([1000, 1010], [50, 51]), _fake_result([990, 1005], [50.5, 49.5])]
    b = [_fake_result([1500, 1490], [50, 50.2]), _fake_result([1510, 1495], [51, 49.8])]
    rows = {m["metric"]: m for m in compare_results(a, b)}
    assert rows["prefill 512 tok/s"]["a"] == [1000, 1010, 990, 1005]
    assert rows["prefill 512 tok/s"]["verdict"] == "faster"
    assert rows["decode @0 tok/s"]["verdict"] == "noise"
    assert rows["decode @0 J/token"]["verdict"] == "noise"
    assert rows["decode @0 J/token"]["median_a"] == pytest.approx(0.5)
    info = {
        "run": {"command": "moestream bench --compare", "date": "today"},
        "machine": machine_info("cpu"),
        "model": {
            "path": "m.gguf",
            "architecture": "qwen3moe",
            "file_type": "Q4_K_M",
            "file_size": 2**20,
        },
    }
    side = {"args": "", "checkout": None, "git": None}
    result = {
        "schema": COMPARE_SCHEMA,
        **info,
        "sides": {"A": side, "B": side},
        "base_args": "m.gguf",
        "order": ["A", "B", "B", "A"],
        "runs": [],
        "metrics": list(rows.values()),
    }
    write_report(result, tmp_path)
    md = format_markdown(result)
    assert "| prefill 512 tok/s |" in md and "faster" in md and "noise" in md
    assert _is_png(tmp_path / "result.png")


class _FakeNVML:
    """NVML stand-in: 250 W, energy counter advancing 1 J per reading."""

    def __init__(self) -> None:
        self.energy_mj = 0

    def nvmlDeviceGetPowerUsage(self, handle) -> int:  # noqa: N802 (NVML's name)
        return 250_000

    def nvmlDeviceGetTotalEnergyConsumption(self, handle) -> int:  # noqa: N802
        self.energy_mj += 1000
        return self.energy_mj

    def nvmlShutdown(self) -> None:  # noqa: N802
        pass


def test_power_sampler() -> None:
    cpu = open_power_sampler("cpu")
    assert not cpu.available and "cpu" in cpu.reason
    with cpu.measure() as m:
        pass
    assert m.result() is None
    sampler = PowerSampler(handle=object(), nvml=_FakeNVML(), interval_s=0.005)
    with sampler.measure() as m:
        import time

        time.sleep(0.03)
    res = m.result()
    assert res["mean_power_w"] == 250.0 and res["n_samples"] >= 2
    assert res["energy_source"] == "counter" and res["energy_j"] == pytest.approx(1.0)
    assert res["seconds"] >= 0.03


def test_machine_and_copy_bandwidth(tmp_path: Path) -> None:
    info = machine_info("cpu")
    assert info["ram_bytes"] > 0 and info["torch"] and info["gpu"] is None
    assert git_info(tmp_path)["commit"] is None
    assert measure_copy_bandwidth("cpu", nbytes=2**20, repeats=3) > 0


def test_bench_reports_expert_counters_when_streaming(tmp_path: Path) -> None:
    """With an expert budget the run carries the store's counters (and only then)."""
    from moestream.cli import DEMO_MODEL

    out = tmp_path / "experts"
    argv = ["bench", str(DEMO_MODEL), "--prompt-lens", "16", "--decode-depths", "0"]
    argv += ["--decode-tokens", "4", "--repeats", "1", "--warmup", "0", "--threads", "1"]
    argv += ["--gpu-expert-cache-gib", "0.004", "--out", str(out)]
    assert main(argv) == 0
    r = json.loads((out / "result.json").read_text())
    c = r["experts"]["counters"]
    assert c["tokens"] > 0 and c["device_hits"] + c["device_misses"] > 0
    assert c["bytes_from_disk"] > 0  # the budget holds fewer experts than the model has
    phases = c["phases"]  # prompts and decode steps counted apart
    assert phases["prefill"]["tokens"] > 0 and phases["decode"]["tokens"] > 0
    assert phases["prefill"]["tokens"] + phases["decode"]["tokens"] == c["tokens"]
    report = (out / "result.md").read_text()
    assert r["experts"]["budgets"] and "| expert store counter | all | prefill | decode |" in report


def test_bench_concurrency_sweep(tmp_path: Path) -> None:
    """--concurrency adds aggregate and per-request decode rows (per request = aggregate / c)."""
    from moestream.cli import DEMO_MODEL

    out = tmp_path / "conc"
    argv = ["bench", str(DEMO_MODEL), "--prompt-lens", "16", "--decode-depths", "0"]
    argv += ["--decode-tokens", "4", "--repeats", "1", "--warmup", "0", "--threads", "1"]
    argv += ["--concurrency", "1,3", "--concurrency-prompt", "8", "--out", str(out)]
    argv += ["--temperature", "0.7"]  # sampled requests: the same sweep
    assert main(argv) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["config"]["temperature"] == 0.7
    rows = result["concurrency"]["rows"]
    assert [r["concurrency"] for r in rows] == [1, 3]
    for r in rows:
        s = r["samples"][0]
        assert s["aggregate_tok_s"] > 0 and s["decode_s"] > 0
        assert abs(s["per_request_tok_s"] * r["concurrency"] - s["aggregate_tok_s"]) < 1e-6
    assert "## concurrency" in (out / "result.md").read_text()
    assert "(sampled at temperature 0.7)" in (out / "result.md").read_text()


def test_git_info_takes_a_stated_commit(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MOESTREAM_COMMIT", "0c53846")
    assert git_info(tmp_path) == {"path": str(tmp_path), "commit": "0c53846", "dirty": None}


def test_decode_params_sample_with_seeds() -> None:
    """--temperature: greedy at 0; above, seeded requests (the same draws on every engine)."""
    from moestream.bench.runner import BenchConfig, decode_params

    greedy = decode_params(BenchConfig().temperature, 5, 7)
    assert greedy.temperature == 0 and greedy.seed is None and greedy.max_tokens == 5
    sampled = decode_params(BenchConfig(temperature=0.8).temperature, 5, 7)
    assert sampled.temperature == 0.8 and sampled.seed == 7 and sampled.ignore_eos
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(RequestError, match="--temperature"):
            BenchConfig(temperature=bad)
    assert json.loads(json.dumps(asdict(BenchConfig(temperature=0.8))))["temperature"] == 0.8


def test_decode_and_concurrency_time_whole_steps_only(monkeypatch) -> None:
    """An engine that queues the next step before the host reads a token (run-ahead) has step 1
    partly done when the prefill's token arrives. Timed from there, k tokens took less than k
    steps (the old method's ~0.8-step bias on the H200); both sections start the clock one
    decoded token later, so a fake engine whose steps take 1.0 s measures exactly 1 tok/s."""
    import contextlib
    import time
    from types import SimpleNamespace

    import torch

    from moestream.bench.concurrency_section import ConcurrencySection
    from moestream.bench.runner import BenchConfig, BenchContext, DecodeSection

    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def step_done(i: int) -> float:  # step i (1 = the first decode step) ends at i - 0.7
        return i - 0.7

    class FakeLLM:
        device = torch.device("cpu")
        config = SimpleNamespace(vocab_size=100)

        def stream(self, ids, params):
            yield SimpleNamespace(new_token_ids=[1])  # the prefill's token, at the clock's 0
            for i in range(1, params.max_tokens):
                clock[0] = step_done(i)
                yield SimpleNamespace(new_token_ids=[1])

    class FakeEngine:  # one request at a time (c = 1), the same step times
        def __init__(self):
            self.left, self.i = 0, -1

        def add_request(self, ids, params):
            self.left, self.i, clock[0] = params.max_tokens, -1, 0.0
            return "r"

        def step(self):
            self.i += 1
            if self.i > 0:
                clock[0] = step_done(self.i)
            self.left -= 1
            return [SimpleNamespace(new_token_ids=[1], request_id="r", finished=self.left == 0)]

    llm = FakeLLM()
    llm.engine = FakeEngine()
    no_power = SimpleNamespace(result=lambda: None)
    power = SimpleNamespace(measure=lambda: contextlib.nullcontext(no_power))
    cfg = BenchConfig(decode_depths=(0,), decode_tokens=8, repeats=1, warmup=0,
                      concurrency=(1,), concurrency_prompt=4)  # fmt: skip
    ctx = BenchContext(llm, cfg, power, 64, 1, 1, None)
    row = DecodeSection().run(ctx)["rows"][0]
    assert row["samples"][0]["tokens"] == 8
    assert row["tok_s"]["median"] == pytest.approx(1.0)  # the old method: 8 / 7.3
    crow = ConcurrencySection().run(ctx)["rows"][0]
    assert crow["aggregate_tok_s"]["median"] == pytest.approx(1.0)


def test_speculation_bench_times_from_the_first_decode_step(monkeypatch) -> None:
    """`decode_run` (the speculative section, bench/spec_figures.py): the prefill's token and
    the first decode step's are untimed, so a fake engine whose steps take 1.0 s each, the
    first partly run before its token was read, gives exactly 1 tok/s; a run too short to time
    anything is an error."""
    import time
    from types import SimpleNamespace

    from moestream.bench.spec_section import decode_run

    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    class FakeEngine:
        speculator = None

        def add_request(self, ids, params):
            self.left, self.i, clock[0] = params.max_tokens, -1, 0.0
            return "r"

        def has_unfinished(self):
            return self.left > 0

        def step(self):
            self.i += 1
            if self.i > 0:
                clock[0] = self.i - 0.7  # step 1 ends 0.3 s after the prefill's token
            self.left -= 1
            return [SimpleNamespace(new_token_ids=[7], request_id="r", finished=self.left == 0)]

    res = decode_run(FakeEngine(), [[1, 2, 3]], 10)
    assert res["tokens"] == 8 and res["tok_s"] == pytest.approx(1.0)
    with pytest.raises(RuntimeError, match="no timed token"):
        decode_run(FakeEngine(), [[1, 2, 3]], 2)
