"""`moestream eval`: accuracy against a reference and exactness gates; exit status 1 on a failure.

    moestream eval MODEL --reference REF [--text FILE] [--ctx 512] [--min-top1 0.9 --max-kl 0.1]
    moestream eval MODEL --lossless [--gen-tokens 32]
    moestream eval MODEL --determinism 3

The three can be combined in one call. A reference that needs an optional package that is not
installed (llama-cpp-python) is reported as skipped (exit 0 when nothing else fails); the JSON
says `"status": "skipped"` so that a CI gate can tell.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moestream.errors import ModelFormatError, RequestError


def add_eval_parser(
    sub: Any,
    model_arg: Callable[[argparse.ArgumentParser], None],
    engine_args: Callable[[argparse.ArgumentParser], None],
) -> argparse.ArgumentParser:
    from moestream.eval.logits_eval import DEFAULT_MAX_KL, DEFAULT_MIN_TOP1

    p = sub.add_parser(
        "eval",
        help="top-1/KL/perplexity vs a reference; lossless and determinism gates",
        description="Accuracy and exactness gates. Exit status 1 when a gate fails.",
    )
    model_arg(p)
    g = p.add_argument_group("reference (top-1 agreement, KL, perplexity)")
    g.add_argument(
        "--reference",
        default=None,
        metavar="REF",
        help="Hugging Face folder (transformers, float32) or GGUF file (llama.cpp)",
    )
    g.add_argument("--reference-device", default="cpu", help="device of the reference")
    g.add_argument(
        "--text",
        default=None,
        metavar="FILE",
        help="text to score (default: bundled held-out Python sample)",
    )
    g.add_argument("--ctx", type=int, default=512, help="tokens per scored window")
    g.add_argument(
        "--max-text-tokens",
        type=int,
        default=None,
        help="score only the first N tokens of the text",
    )
    g.add_argument(
        "--min-top1", type=float, default=DEFAULT_MIN_TOP1, help="gate: least top-1 agreement"
    )
    g.add_argument(
        "--max-kl",
        type=float,
        default=DEFAULT_MAX_KL,
        help="gate: largest mean KL(ref || ours) in nats",
    )
    x = p.add_argument_group("exactness (greedy outputs token-identical)")
    x.add_argument(
        "--lossless",
        action="store_true",
        help="every execution mode gives the outputs of plain decode",
    )
    x.add_argument(
        "--determinism",
        type=int,
        default=None,
        metavar="N",
        help="N fresh instances give identical outputs",
    )
    x.add_argument("--gen-tokens", type=int, default=32, help="greedy tokens per prompt")
    x.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="use only the first N prompts of the bundled set",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
    engine_args(p)
    p.set_defaults(func=_cmd_eval)
    return p


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from moestream.cli import llm_kwargs_from_args

    return llm_kwargs_from_args(args)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _run_reference(args: argparse.Namespace, engine: dict[str, Any]) -> dict[str, Any]:
    from moestream.eval.logits_eval import DEFAULT_TEXT, evaluate_logits, format_logits_result
    from moestream.eval.references import ReferenceUnavailable, open_reference
    from moestream.llm import LLM

    text_path = Path(args.text) if args.text else DEFAULT_TEXT
    if not text_path.is_file():
        raise RequestError(f"--text {text_path}: no such file")
    if args.ctx < 2:
        raise RequestError(f"--ctx must be >= 2, got {args.ctx}")
    try:
        ref = open_reference(args.reference, n_ctx=args.ctx, device=args.reference_device)
    except ReferenceUnavailable as e:
        print(f"moestream eval: reference skipped: {e}", file=sys.stderr)
        return {"status": "skipped", "reason": str(e), "reference": str(args.reference)}
    llm = LLM(args.model, **engine)
    if args.ctx > llm.engine.max_model_len:
        raise RequestError(
            f"--ctx {args.ctx} exceeds the model's context of {llm.engine.max_model_len} tokens"
        )
    if ref.vocab_size != llm.config.vocab_size:
        raise ModelFormatError(
            f"reference {args.reference} has a vocabulary of {ref.vocab_size} tokens, "
            f"{args.model} one of {llm.config.vocab_size}: not the same model"
        )
    ids = llm.tokenizer.encode(text_path.read_text(encoding="utf-8"))
    if args.max_text_tokens is not None:
        ids = ids[: args.max_text_tokens]
    _log(f"eval: {len(ids)} tokens of {text_path} in windows of {args.ctx}")
    result = evaluate_logits(
        llm.logits,
        ref.logits,
        ids,
        ctx=args.ctx,
        min_top1=args.min_top1,
        max_kl=args.max_kl,
        progress=lambda i, n: _log(f"eval: window {i}/{n}") if i == n or i % 8 == 0 else None,
    )
    print(format_logits_result(result, str(args.model), ref.name))
    return {
        "status": "passed" if result.passed else "failed",
        "text": str(text_path),
        "ctx": args.ctx,
        "reference": ref.name,
        **result.to_json(),
    }


def _cmd_eval(args: argparse.Namespace) -> int:
    from moestream.eval.lossless import (
        format_exactness,
        run_determinism,
        run_lossless,
    )
    from moestream.eval.prompts import LOSSLESS_PROMPTS

    if not (args.reference or args.lossless or args.determinism):
        raise RequestError(
            "nothing to evaluate: give --reference REF, --lossless or --determinism N"
        )
    if args.determinism is not None and args.determinism < 2:
        raise RequestError(f"--determinism needs N >= 2 runs, got {args.determinism}")
    if args.gen_tokens < 1:
        raise RequestError(f"--gen-tokens must be >= 1, got {args.gen_tokens}")
    engine = _engine_kwargs(args)
    prompts = LOSSLESS_PROMPTS[: args.num_prompts] if args.num_prompts else LOSSLESS_PROMPTS
    report: dict[str, Any] = {
        "schema": "moestream.eval/1",
        "model": str(args.model),
        "engine": engine,
    }
    failed = False
    if args.reference:
        report["reference"] = _run_reference(args, engine)
        failed |= report["reference"]["status"] == "failed"
    if args.lossless:
        r = run_lossless(args.model, engine, prompts, args.gen_tokens, log=_log)
        print(format_exactness(r, "lossless"))
        report["lossless"] = r
        failed |= not r["passed"]
    if args.determinism:
        r = run_determinism(
            args.model, engine, args.determinism, prompts, args.gen_tokens, log=_log
        )
        print(format_exactness(r, "determinism"))
        report["determinism"] = r
        failed |= not r["passed"]
    report["passed"] = not failed
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failed else 0
