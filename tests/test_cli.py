"""The command line as a user meets it: errors they can cause are one line and exit status 2
(no traceback unless --debug), every command explains itself with --help, and flags can come
from MOESTREAM_* environment variables."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moestream.cli import DEMO_MODEL, build_parser


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moestream.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda p: p.write_bytes(DEMO_MODEL.read_bytes()[:100_000]), "truncated"),
        (lambda p: p.write_bytes(b"GGUX" + DEMO_MODEL.read_bytes()[4:4096]), "not a GGUF file"),
        (lambda p: None, "no such file"),
    ],
)
def test_bad_model_file_is_one_line_and_status_2(tmp_path: Path, make, needle: str) -> None:
    path = tmp_path / "model.gguf"
    make(path)
    proc = run("info", str(path))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith("moestream: error: ")
    assert str(path) in lines[0] and needle in lines[0]


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    proc = run("--debug", "info", str(tmp_path / "missing.gguf"))
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_bad_sampling_parameter_is_one_line() -> None:
    proc = run("generate", "-p", "x", "--top-p", "1.5", "--max-tokens", "2")
    assert proc.returncode == 2 and "top_p" in proc.stderr and "Traceback" not in proc.stderr


def test_every_command_has_help() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) >= {
        "serve", "generate", "chat", "convert", "info", "synth", "bench", "eval", "tune"
    }  # fmt: skip
    for name, p in sub.choices.items():
        text = p.format_help()
        assert p.description or any(a.help for a in p._actions), name
        assert "--help" in text


def test_flags_read_environment_and_the_flag_wins() -> None:
    env_before = os.environ.get("MOESTREAM_MAX_TOKENS")
    os.environ["MOESTREAM_MAX_TOKENS"] = "7"
    try:
        args = build_parser().parse_args(["generate", "-p", "x"])
        assert args.max_tokens == 7
        args = build_parser().parse_args(["generate", "-p", "x", "--max-tokens", "3"])
        assert args.max_tokens == 3
    finally:
        if env_before is None:
            del os.environ["MOESTREAM_MAX_TOKENS"]
        else:
            os.environ["MOESTREAM_MAX_TOKENS"] = env_before


def test_generate_streams_from_the_demo_model() -> None:
    proc = run("generate", "-p", "def add(a, b):", "--max-tokens", "8", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def add(a, b):") and len(proc.stdout) > len("def add(a, b):")
    assert "tok/s" in proc.stderr


def test_expert_flags_reach_the_llm_on_every_command() -> None:
    from moestream.cli import llm_kwargs_from_args

    for command in (["generate", "-p", "x"], ["serve"], ["bench"]):
        args = build_parser().parse_args(
            [*command, "--expert-zero-copy", "--expert-rebalance-steps", "32"]
        )
        kwargs = llm_kwargs_from_args(args)
        assert kwargs["expert_zero_copy"] is True, command
        assert kwargs["expert_rebalance_steps"] == 32, command


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without CUDA")
def test_tune_without_cuda_is_one_line_and_status_2(tmp_path: Path) -> None:
    proc = run("tune", "--cache-dir", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moestream: error: tune needs a CUDA GPU")
    assert not list(tmp_path.iterdir())  # nothing written


def test_tune_help_says_results_never_change_bits() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = " ".join(sub.choices["tune"].format_help().split())
    assert "never change bits" in text and "MOESTREAM_TUNE_CACHE=off" in text
