"""/metrics carries the expert-tier and speculation counters when those are on."""

from __future__ import annotations

from fastapi.testclient import TestClient

from moestream import LLM


def test_metrics_include_expert_counters(model_path) -> None:
    from moestream.server.app import build_app
    from moestream.server.serving import ServerConfig

    llm = LLM(model_path, gpu_expert_cache_gib=0.004, num_threads=1)
    assert llm.expert_store is not None
    with TestClient(build_app(llm, ServerConfig(model_names=["m"]))) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": "def f(x):", "max_tokens": 4})
        assert r.status_code == 200
        text = c.get("/metrics").text
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln[:1] != "#"}
    assert lines["moestream_expert_tokens_total"] > 0
    accesses = lines["moestream_expert_device_hits_total"]
    accesses += lines["moestream_expert_device_misses_total"]
    assert accesses > 0
    # A budget below the model's experts: some had to be read from the file.
    assert lines["moestream_expert_bytes_from_disk_total"] > 0


def test_metrics_include_speculation_counters(model_path) -> None:
    """With n-gram speculation on, /metrics counts verify steps and drafts per proposer."""
    from moestream.server.app import build_app
    from moestream.server.serving import ServerConfig
    from moestream.spec.base import SpecConfig

    # `always`: draft at every step (the picker would first measure costs over many steps).
    llm = LLM(model_path, speculative=SpecConfig(mode="ngram", always=True), num_threads=1)
    prompt = "def f(x):\n    return x + 1\n\n" * 6
    with TestClient(build_app(llm, ServerConfig(model_names=["m"]))) as c:
        r = c.post(
            "/v1/completions",
            json={"model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0},
        )
        assert r.status_code == 200
        text = c.get("/metrics").text
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln[:1] != "#"}
    assert lines['moestream_spec_verify_steps_total{proposer="ngram"}'] > 0
    assert lines['moestream_spec_draft_tokens_total{proposer="ngram"}'] > 0
    assert 'moestream_spec_tau{proposer="ngram"}' in lines


def test_metrics_include_zero_copy_reads(model_path) -> None:
    from moestream.server.app import build_app
    from moestream.server.serving import ServerConfig

    llm = LLM(
        model_path, gpu_expert_cache_gib=0.004, host_expert_cache_gib=1.0,
        expert_zero_copy=True, num_threads=1,
    )  # fmt: skip
    with TestClient(build_app(llm, ServerConfig(model_names=["m"]))) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": "def f(x):", "max_tokens": 4})
        assert r.status_code == 200
        text = c.get("/metrics").text
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln[:1] != "#"}
    reads = lines["moestream_expert_zero_copy_device_reads_total"]
    reads += lines["moestream_expert_zero_copy_host_reads_total"]
    assert reads > 0
    share = lines["moestream_expert_zero_copy_device_read_share"]
    assert 0.0 <= share <= 1.0
    assert lines["moestream_expert_zero_copy_host_link_bytes_total"] > 0
