"""Shared server fixtures: a tiny random Qwen3-MoE model with the fixtures' tokenizer (or the
embedded demo model once it exists), an `LLM` over it, the app in-process (`TestClient`) and
on a real loopback socket (uvicorn in a thread, random free port)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent.parent / "fixtures"
MODEL_NAME = "tiny"
MAX_MODEL_LEN = 256

_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 4096,  # the fixtures' tokenizer
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 0,
    "pad_token_id": 0,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def make_tiny_qwen3moe(path: Path, seed: int = 0) -> Path:
    """Write a random Qwen3-MoE Hugging Face folder (float32 safetensors + fixture tokenizer)."""
    from safetensors.torch import save_file

    c = _CONFIG
    g = torch.Generator().manual_seed(seed)
    h, d, v = c["hidden_size"], c["head_dim"], c["vocab_size"]

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / cols**0.5

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, generator=g)

    t = {"model.embed_tokens.weight": torch.randn(v, h, generator=g), "lm_head.weight": mat(v, h)}
    t["model.norm.weight"] = norm(h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(h)
        t[p + "post_attention_layernorm.weight"] = norm(h)
        t[p + "self_attn.q_proj.weight"] = mat(c["num_attention_heads"] * d, h)
        t[p + "self_attn.k_proj.weight"] = mat(c["num_key_value_heads"] * d, h)
        t[p + "self_attn.v_proj.weight"] = mat(c["num_key_value_heads"] * d, h)
        t[p + "self_attn.o_proj.weight"] = mat(h, c["num_attention_heads"] * d)
        t[p + "self_attn.q_norm.weight"] = norm(d)
        t[p + "self_attn.k_norm.weight"] = norm(d)
        t[p + "mlp.gate.weight"] = mat(c["num_experts"], h)
        for e in range(c["num_experts"]):
            f = c["moe_intermediate_size"]
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = mat(f, h)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = mat(f, h)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = mat(h, f)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: x.contiguous() for k, x in t.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(c))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / name, path / name)
    return path


@pytest.fixture(scope="session")
def model_path(tmp_path_factory) -> Path:
    from moestream.cli import DEMO_MODEL

    if DEMO_MODEL.exists():
        return DEMO_MODEL
    return make_tiny_qwen3moe(tmp_path_factory.mktemp("tiny-qwen3moe"))


@pytest.fixture(scope="session")
def llm(model_path):
    from moestream.llm import LLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: extra threads only spin against each other
    yield LLM(model_path, device="cpu", max_model_len=MAX_MODEL_LEN, max_num_seqs=64)
    torch.set_num_threads(threads)


def make_app(llm, **config):
    from moestream.server.app import build_app
    from moestream.server.serving import ServerConfig

    return build_app(llm, ServerConfig(model_names=[MODEL_NAME], **config))


@pytest.fixture
def app_factory(llm):
    """make(**ServerConfig fields) -> a fresh app over the shared engine."""
    return lambda **config: make_app(llm, **config)


@pytest.fixture
def client(llm):
    """The app in-process. One app per test: two apps must never drive one engine at once."""
    from fastapi.testclient import TestClient

    with TestClient(make_app(llm)) as c:
        yield c


def _engine_idle(llm, timeout: float = 10.0) -> bool:
    """Wait until the engine holds no request and no KV block."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = llm.engine.scheduler.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_used_blocks == 0:
            return True
        time.sleep(0.02)
    return False


class LiveServer:
    """The app served by uvicorn on 127.0.0.1 and a free port, in a background thread."""

    def __init__(self, app, graceful_s: float = 5.0) -> None:
        import uvicorn

        config = uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning",
            timeout_graceful_shutdown=graceful_s,
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture
def live(llm) -> Iterator[LiveServer]:
    with LiveServer(make_app(llm)) as server:
        yield server


@pytest.fixture
def engine_idle():
    """engine_idle(llm, timeout=10) -> True once the engine holds no request and no block."""
    return _engine_idle


@pytest.fixture
def live_server():
    """LiveServer(app, graceful_s=5): use as a context manager."""
    return LiveServer
