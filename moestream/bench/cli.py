"""`moestream bench`: the command line of the benchmark (runner.py) and its A/B mode (compare.py).

moestream bench MODEL [--prompt-lens 512,4096] [--decode-depths 0,4096] [--repeats 3] ...
moestream bench MODEL --compare "--max-num-batched-tokens 512" "--max-num-batched-tokens 2048"
moestream bench MODEL --compare-checkouts ../main-old ../main-new
moestream bench MODEL --prefix-reuse 32k:31k        # cold vs warm TTFT with a shared prefix
moestream bench MODEL --verify-curve 1,2,4,8,16     # step cost of k tokens per request vs k=1
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Options of the bench itself that a compare run passes on to its children.
_CHILD_OPTIONS = (
    "prompt_lens",
    "decode_depths",
    "decode_tokens",
    "repeats",
    "warmup",
    "seed",
    "copy_bandwidth",
    "concurrency",
    "concurrency_prompt",
    "prefix_reuse",
    "verify_curve",
    "verify_batches",
    "verify_tau",
)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(_parse_count(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token counts, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one token count")
    return values


def _positive_list(text: str) -> tuple[int, ...]:
    values = _int_list(text)
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    return values


def _tau_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        msg = f"expected comma-separated numbers, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if not values or not all(v >= 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected tau values >= 1, got {text!r}")
    return values


def _prefix_reuse(text: str) -> tuple[int, int]:
    """'LEN[:SHARED]' -> (LEN, SHARED); SHARED defaults to LEN - 1024."""
    n_text, _, shared_text = text.partition(":")
    try:
        n = _parse_count(n_text)
        shared = _parse_count(shared_text) if shared_text else n - 1024
    except ValueError:
        msg = f"expected LEN[:SHARED] token counts, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if not shared_text and shared < 1:
        raise argparse.ArgumentTypeError(
            f"SHARED defaults to LEN - 1024, which needs LEN > 1024; give LEN:SHARED, got {text!r}"
        )
    if not 1 <= shared < n:
        raise argparse.ArgumentTypeError(f"expected 1 <= SHARED < LEN, got {text!r}")
    return n, shared


def _parse_count(x: str) -> int:
    """'512' -> 512, '4k' -> 4096, '32K' -> 32768."""
    x = x.strip().lower()
    return int(x[:-1]) * 1024 if x.endswith("k") else int(x)


def add_bench_parser(
    sub: Any,
    model_arg: Callable[[argparse.ArgumentParser], None],
    engine_args: Callable[[argparse.ArgumentParser], None],
) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench",
        help="prefill/decode tok/s, memory, power, ceiling; A/B with --compare",
        description="Measure prefill tok/s at prompt lengths and decode tok/s at context "
        "depths through the engine; write result.json, result.md and result.png.",
    )
    model_arg(p)
    g = p.add_argument_group("bench")
    g.add_argument(
        "--prompt-lens",
        type=_int_list,
        default=None,
        help="prefill prompt lengths, e.g. 512,4k,16k (default 512,4k,16k,32k, those "
        "that fit the context)",
    )
    g.add_argument(
        "--decode-depths",
        type=_int_list,
        default=None,
        help="context depths for decode (default 0 and the prompt lengths)",
    )
    g.add_argument("--decode-tokens", type=int, default=128, help="tokens timed per decode run")
    g.add_argument(
        "--concurrency",
        type=_int_list,
        default=(),
        help="concurrent-decode sweep, e.g. 1,2,4,8,16,32: aggregate and per-request tok/s "
        "(default: no sweep)",
    )
    g.add_argument(
        "--concurrency-prompt",
        type=int,
        default=128,
        help="prompt tokens per request in the sweep (and the --verify-curve context depth)",
    )
    g.add_argument(
        "--prefix-reuse",
        type=_prefix_reuse,
        default=None,
        metavar="LEN[:SHARED]",
        help="time to first token of a fresh LEN-token prompt (cold) and of one sharing its "
        "first SHARED tokens (warm, served by the prefix cache), e.g. 32k:31k (SHARED "
        "default LEN - 1024; default: off)",
    )
    g.add_argument(
        "--verify-curve",
        type=_positive_list,
        default=(),
        metavar="KS",
        help="step cost when each request feeds k tokens (its last + k - 1 drafts) relative "
        "to plain decode (k=1), e.g. 1,2,4,8,16, at depth --concurrency-prompt (default: off)",
    )
    g.add_argument(
        "--verify-batches",
        type=_positive_list,
        default=(1, 4, 16),
        metavar="BS",
        help="requests per step for --verify-curve (default 1,4,16)",
    )
    g.add_argument(
        "--verify-tau",
        type=_tau_list,
        default=(2.0, 3.0, 4.0),
        metavar="TAUS",
        help="mean accepted lengths for the implied speedup tau / cost(k) (default 2,3,4)",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of the decode and concurrency runs (default 0: greedy); "
        "above 0 each request samples with a seed of its own",
    )
    g.add_argument("--repeats", type=int, default=3, help="measured runs per row")
    g.add_argument("--warmup", type=int, default=1, help="discarded runs per row")
    g.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids")
    g.add_argument(
        "--copy-bandwidth",
        type=float,
        default=None,
        metavar="GBPS",
        help="device copy bandwidth for the ceiling (default: measured)",
    )
    g.add_argument("--out", default=None, help="output folder (default bench-results/<timestamp>)")
    g.add_argument(
        "--json-only",
        action="store_true",
        help="write result.json only (used by --compare's child runs)",
    )
    c = p.add_argument_group("compare")
    c.add_argument(
        "--compare",
        nargs=2,
        metavar=("ARGS_A", "ARGS_B"),
        default=None,
        help="A/B of two sets of extra arguments, each one quoted string",
    )
    c.add_argument(
        "--compare-checkouts",
        nargs=2,
        metavar=("DIR_A", "DIR_B"),
        default=None,
        help="A/B of two source checkouts (each child imports moestream from its DIR)",
    )
    c.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="child runs per side, interleaved A B B A A B ... (default 3)",
    )
    before = len(p._actions)
    engine_args(p)
    p.set_defaults(func=_cmd_bench, _engine_actions=p._actions[before:])
    return p


def _engine_config(args: argparse.Namespace) -> dict[str, Any]:
    return {a.dest: getattr(args, a.dest) for a in args._engine_actions}


def _engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of this invocation, to pass on to a child run."""
    out: list[str] = []
    for a in args._engine_actions:
        value = getattr(args, a.dest)
        flag = a.option_strings[-1]
        if isinstance(a, argparse._StoreTrueAction):
            if value:
                out.append(flag)
        elif isinstance(a, argparse._StoreFalseAction):
            if not value:
                out.append(flag)
        elif value is not None and value != a.default:
            out += [flag, str(value)]
    return out


def _child_argv(args: argparse.Namespace) -> list[str]:
    out = [str(args.model)]
    for name in _CHILD_OPTIONS:
        value = getattr(args, name)
        if value is None or value == ():
            continue
        flag = "--" + name.replace("_", "-")
        sep = ":" if name == "prefix_reuse" else ","
        out += [flag, sep.join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return out + _engine_argv(args)


def _default_out() -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("bench-results") / stamp


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _cmd_bench(args: argparse.Namespace) -> int:
    from moestream.bench.report import format_markdown, write_report

    out = Path(args.out) if args.out else _default_out()
    if args.compare or args.compare_checkouts:
        from moestream.bench.compare import run_compare, sides_from_args

        sides = sides_from_args(args.compare, args.compare_checkouts)
        result = run_compare(
            sides, _child_argv(args), args.rounds, argv=args.command_line, log=_log
        )
    else:
        result = _run_single(args)
    write_report(result, out, json_only=args.json_only)
    if not args.json_only:
        print(format_markdown(result))
        print(f"wrote {out}/result.json, result.md, result.png", file=sys.stderr)
    return 0


def _run_single(args: argparse.Namespace) -> dict[str, Any]:
    from moestream.bench.runner import (
        DEFAULT_PROMPT_LENS,
        BenchConfig,
        measure_copy_bandwidth,
        run_bench,
    )
    from moestream.cli import _llm_from  # the engine flags -> LLM, shared with generate/serve
    from moestream.llm import resolve_device

    prompt_lens = args.prompt_lens or DEFAULT_PROMPT_LENS
    depths = args.decode_depths or (0, *prompt_lens)
    config = BenchConfig(
        prompt_lens=tuple(prompt_lens),
        decode_depths=tuple(depths),
        decode_tokens=args.decode_tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        seed=args.seed,
        copy_bandwidth_gbps=args.copy_bandwidth,
        concurrency=tuple(args.concurrency),
        concurrency_prompt=args.concurrency_prompt,
        prefix_reuse=args.prefix_reuse,
        verify_ks=tuple(args.verify_curve),
        verify_batches=tuple(args.verify_batches),
        verify_tau=tuple(args.verify_tau),
        temperature=args.temperature,
    )
    measured = None
    if config.copy_bandwidth_gbps is None:
        # Before the model and its KV pool take the device's memory.
        measured = measure_copy_bandwidth(resolve_device(args.device))
    llm = _llm_from(args)
    return run_bench(
        llm,
        config,
        engine_config=_engine_config(args),
        measured_bandwidth_gbps=measured,
        argv=args.command_line,
        log=_log,
    )
