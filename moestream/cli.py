"""`moestream` command line: serve | generate | chat | convert | info | synth | bench | eval | tune.

Every option also reads an environment variable `MOESTREAM_<OPTION>` (dashes become
underscores); a flag given on the command line wins. Errors the user can cause print one line
and exit with status 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from moestream.errors import MoestreamError

DEMO_MODEL = Path(__file__).parent / "data" / "tiny-qwen3-moe-Q4_K_M.gguf"
DEMO_DRAFT = Path(__file__).parent / "data" / "tiny-qwen3-draft-Q8_0.gguf"


_TRUE = ("1", "true", "yes", "on")


def _apply_env_defaults(parser: argparse.ArgumentParser) -> None:
    """Let every long option of `parser` and its subcommands default to MOESTREAM_<OPTION>
    (a flag on the command line still wins), and say so in --help. Done once the parser is
    built so that options in argument groups are covered too."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _apply_env_defaults(sub)
            continue
        long = next((o for o in action.option_strings if o.startswith("--")), None)
        if long is None or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        env = "MOESTREAM_" + long[2:].upper().replace("-", "_")
        if action.help and action.help != argparse.SUPPRESS and env not in action.help:
            action.help += f" [env {env}]"
        value = os.environ.get(env)
        if value is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = value.lower() in _TRUE
        elif isinstance(action, argparse._StoreFalseAction):
            action.default = value.lower() not in _TRUE
        else:
            try:
                action.default = action.type(value) if action.type else value
            except ValueError:
                print(f"moestream: error: {env}={value!r} is not valid for {long}", file=sys.stderr)
                raise SystemExit(2) from None


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=os.environ.get("MOESTREAM_MODEL", str(DEMO_MODEL)),
        help="GGUF file or Hugging Face folder (default: the embedded demo model) "
        "[env MOESTREAM_MODEL]",
    )


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if present)")
    g.add_argument(
        "--dtype",
        default=None,
        help="activation dtype: float32, bfloat16, float16 (default: "
        "float32 on CPU, bfloat16 on GPU)",
    )
    g.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens")
    g.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="KV pool size in GiB (default: 1 on CPU; on a GPU 90%% of free memory, less an "
        "estimate of what a step's activations need)",
    )
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests in one step")
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="token budget per step (chunk)"
    )
    g.add_argument(
        "--no-prefix-caching", action="store_true", help="disable reuse of cached prompt blocks"
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run decode and verification steps eagerly instead of as CUDA graphs (CUDA only; "
        "for debugging)",
    )
    g.add_argument(
        "--weight-cache-gib",
        type=float,
        default=None,
        help="keep dequantized copies of up to N GiB of quantized weights so that matmuls skip "
        "dequantizing them. CUDA: bf16 copies (attention and dense weights first, then resident "
        "experts) for prefill and batched "
        "decode (16+ tokens); batch-1 decode still reads the quantized weights (default 0: "
        "none). CPU: copies in the model's dtype for every matmul (default 4 GiB); 0: none",
    )
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant GPU kernels: a request's greedy text does not depend on the other "
        "requests, the prefill chunk size or prefix-cache hits (costs prefill speed; the CPU "
        "path is invariant already)",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: one per 256 MiB of weights, at most one per core: "
        "small models run fastest on one)",
    )
    s = p.add_argument_group("speculative decoding (greedy output unchanged)")
    s.add_argument(
        "--speculative",
        default="off",
        choices=["off", "ngram", "draft", "auto"],
        help="proposer: n-gram lookup over prompt and output, a draft model, or auto (both "
        "where available; a cost model picks per request and step, and plain decode when "
        "speculation does not pay)",
    )
    s.add_argument(
        "--draft-model",
        default=None,
        metavar="PATH",
        help="draft model GGUF sharing the target's tokenizer (default: the embedded draft "
        "when the target is the demo model; otherwise needed by --speculative draft, and "
        "auto without it uses n-gram lookup only)",
    )
    s.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=4,
        metavar="K",
        help="most drafted tokens per request and step",
    )
    e = p.add_argument_group("expert tiers (MoE models larger than the device)")
    _budget_args(e)
    e.add_argument(
        "--expert-policy",
        default="window",
        choices=["window", "lru", "lfu"],
        help="which experts stay in device slots: frequency over a window of recent tokens, "
        "least recently used, or least frequently used",
    )
    e.add_argument(
        "--expert-direct-io",
        action="store_true",
        help="read streamed experts from the file with O_DIRECT, past the page cache, so that "
        "every miss of the host tier is a disk read (measuring the disk tier; a filesystem "
        "that refuses O_DIRECT gets buffered reads, and the bench's experts section says which)",
    )
    e.add_argument(
        "--expert-zero-copy",
        action="store_true",
        help="fixed placement instead of streaming: the experts that fit "
        "--gpu-expert-cache-gib stay on the device, the rest in pinned host memory (it must fit "
        "--host-expert-cache-gib) that the GPU kernels read directly; no host sync per layer, "
        "CUDA graphs stay on",
    )
    e.add_argument(
        "--expert-paging",
        choices=["auto", "on", "off"],
        default="auto",
        help="paged experts: every expert in pinned host memory (it must fit "
        "--host-expert-cache-gib) and as many as --gpu-expert-cache-gib holds in device slots; "
        "before each decode forward of a layer the GPU itself pages the routed experts that are "
        "missing into the slots of the coldest ones (frequency over recent forwards), so decode "
        "steps stay whole CUDA graphs with no host work. auto (default): on CUDA wherever the "
        "budgets allow it (`moestream info MODEL --gpu-expert-cache-gib G "
        "--host-expert-cache-gib H` says), else streamed; off: always streamed (docs/experts.md)",
    )
    e.add_argument(
        "--expert-prediction",
        choices=["on", "off"],
        default="on",
        help="next-layer prediction of paged and streamed experts: each layer applies the next "
        "layer's router to its own FFN input and loads the experts it names ahead (paged: into "
        "the next layer's slots on a side stream while this layer computes), as long as at "
        "least half of what such predictions name is then routed (counted in bench's experts "
        "section and /metrics); off: load on demand only",
    )
    e.add_argument(
        "--expert-rebalance-steps",
        type=int,
        default=64,
        metavar="N",
        help="with --expert-zero-copy: every N steps, swap the host-placed experts the routing "
        "used most with the device-placed ones it used least (0: keep the placement of load "
        "time)",
    )
    e.add_argument(
        "--expert-cpu-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="with --expert-zero-copy: the CPU's cores compute this fraction of each layer's "
        "host-placed experts (the GPU reads the rest across the host link), with the GPU's bits, "
        "answering the step's posts from a thread of their own (CUDA graphs stay on). Needs "
        "Q4_K gate/up, a Q4_K or Q6_K down and a C compiler. 0.5 was the fastest share on an "
        "H200 with a 16-core host, 0.6 in one later run at half the experts on the GPU "
        "(bench/RESULTS.md); bench/hybrid_sweep.py measures it for a machine",
    )
    e.add_argument(
        "--expert-cpu-threads",
        type=int,
        default=None,
        metavar="N",
        help="threads for --expert-cpu-fraction (default: one fewer than the cores this process "
        "may use where it may use 8 or more, else all of them)",
    )
    e.add_argument(
        "--expert-prefill-stage",
        action="store_true",
        help="with --expert-zero-copy: keep one layer's host-placed experts' worth of "
        "--gpu-expert-cache-gib as a stage; a forward of 64 tokens or more (prefill) copies each "
        "layer's host experts there at the link's copy rate and reads them on the device, "
        "instead of reading them across the link once per 32 tokens. Same results; a few "
        "experts fewer per layer stay on the device",
    )


def _budget_args(g) -> None:
    g.add_argument(
        "--gpu-expert-cache-gib",
        type=float,
        default=None,
        help="device memory for expert slots; experts that do not fit stream in from host RAM "
        "or the file (default: all experts resident). On a GPU, decode steps whose routed "
        "experts always fit the slots run as chains of CUDA graphs (`moestream info MODEL "
        "--gpu-expert-cache-gib G` says up to which batch size); docs/experts.md",
    )
    g.add_argument(
        "--host-expert-cache-gib",
        type=float,
        default=0.0,
        help="host RAM (pinned on a GPU machine) caching experts read from the file",
    )


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.7, help="0 means greedy")
    g.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens under min_p * p(max)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="HF-style, 1.0 is off")
    g.add_argument("--seed", type=int, default=None, help="same seed, same text")


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated sizes >= 1, got {text!r}")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moestream",
        description="Run Mixture-of-Experts language models from GGUF files.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    _model_arg(p)
    p.add_argument("-p", "--prompt", required=True, help="prompt text ('-' reads stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _sampling_args(p)
    _engine_args(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("chat", help="interactive chat using the model's chat template")
    _model_arg(p)
    p.add_argument("--system", default=None, help="system message")
    _sampling_args(p)
    _engine_args(p)
    p.set_defaults(func=_cmd_chat)

    p = sub.add_parser("info", help="architecture, parameters, quant mix and bytes per token")
    p.add_argument("model", help="GGUF file or Hugging Face folder")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    b = p.add_argument_group("placement under expert budgets")
    _budget_args(b)
    b.add_argument(
        "--hit-rate",
        type=float,
        default=None,
        help="assumed device-slot hit rate for the bytes-per-token estimate",
    )
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("convert", help="write a GGUF from a Hugging Face folder")
    p.add_argument("hf_dir", help="Hugging Face folder (config.json, *.safetensors, tokenizer)")
    p.add_argument("out", help="output .gguf path")
    p.add_argument(
        "--quant", default="Q4_K_M", help="mix: Q4_K_M, Q2_K, Q4_0, Q6_K, Q8_0, F16, BF16, F32"
    )
    p.add_argument(
        "--layer-quant",
        default=None,
        help="per-layer overrides, e.g. '33-39=Q4_K' or '0=Q8_0,46-47=Q6_K'",
    )
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("synth", help="write a GGUF of random valid blocks in a real model's shapes")
    p.add_argument("out", help="output .gguf path")
    p.add_argument("--like", required=True, help="model shape preset, e.g. qwen3-30b-a3b")
    p.add_argument(
        "--quant",
        default="Q4_K_M",
        help="quant mix: Q4_K_M, Q4_K, Q6_K, Q2_K, Q8_0, Q4_0, F16 or BF16 (llama.cpp's rules "
        "for which tensors get more bits)",
    )
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    p.add_argument("--experts", type=int, default=None, help="experts per layer (MoE)")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.set_defaults(func=_cmd_synth)

    p = sub.add_parser(
        "tune",
        help="time the decode kernels' launch shapes on this GPU and cache the fastest",
        description="Find the model's decode matmuls (one forward of a token on the GPU), then "
        "for each shape and batch size time the default launch shape and others that compute "
        "every output element the same way (rows per program and warps of the integer-dot "
        "GEMVs and of the MoE's gate/up kernel) on random weights, and cache the fastest per "
        "GPU and Triton version in launch-shapes.json, which the kernels read from then on "
        "(MOESTREAM_TUNE_CACHE=off ignores it). Results never change bits: a launch shape is "
        "kept only if its output is bit for bit the default's, so greedy text stays the same "
        "with or without the cache. The model must fit on the GPU.",
    )
    _model_arg(p)
    p.add_argument("--device", default="cuda", help="CUDA device to tune for (cuda or cuda:N)")
    p.add_argument(
        "--repeats", type=int, default=20, help="timed runs per launch shape (median is kept)"
    )
    p.add_argument(
        "--batch-sizes",
        type=_batch_sizes,
        default=(1, 2, 4, 8),
        help="decode batch sizes to tune, rounded up to powers of two; those a kernel does not "
        "serve are skipped (default 1,2,4,8)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="folder of launch-shapes.json (default ~/.cache/moestream)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="worker processes that compile the launch shapes before they are timed (each "
        "candidate is a Triton compile of its own; 1: compile while timing; default: up to 8)",
    )
    p.set_defaults(func=_cmd_tune)

    from moestream.bench.cli import add_bench_parser
    from moestream.eval.cli import add_eval_parser

    add_bench_parser(sub, _model_arg, _engine_args)
    add_eval_parser(sub, _model_arg, _engine_args)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _model_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8000, help="port")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--served-model-name", default=None, help="model id clients use")
    p.add_argument(
        "--max-concurrency", type=int, default=256, help="most requests in the engine at once"
    )
    p.add_argument(
        "--max-queue", type=int, default=1024,
        help="most requests waiting for a slot; more get 429 with Retry-After",
    )  # fmt: skip
    p.add_argument(
        "--max-request-bytes", type=int, default=16 * 2**20,
        help="largest request body; larger ones get 413",
    )  # fmt: skip
    p.add_argument(
        "--timeout-graceful-shutdown", type=float, default=30.0,
        help="seconds in-flight requests may run on after SIGTERM before they are aborted",
    )  # fmt: skip
    _engine_args(p)
    p.set_defaults(func=_cmd_serve)
    _apply_env_defaults(parser)
    return parser


def _sampling_from(args: argparse.Namespace):
    from moestream.types import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )


def llm_kwargs_from_args(args: argparse.Namespace) -> dict:
    """The engine flags of `_engine_args` as keyword arguments of `LLM` (one mapping for every
    command that builds an LLM)."""
    return {
        "device": args.device,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "kv_cache_gib": args.kv_cache_gib,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": not args.no_prefix_caching,
        "enforce_eager": args.enforce_eager,
        "deterministic": args.deterministic,
        "expert_zero_copy": args.expert_zero_copy,
        "expert_rebalance_steps": args.expert_rebalance_steps,
        "expert_cpu_fraction": args.expert_cpu_fraction,
        "expert_cpu_threads": args.expert_cpu_threads,
        "expert_prefill_stage": args.expert_prefill_stage,
        "expert_paging": {"auto": None, "on": True, "off": False}[args.expert_paging],
        "expert_prediction": args.expert_prediction == "on",
        "expert_direct_io": args.expert_direct_io,
        "weight_cache_gib": args.weight_cache_gib,
        "num_threads": args.threads,
        "gpu_expert_cache_gib": args.gpu_expert_cache_gib,
        "host_expert_cache_gib": args.host_expert_cache_gib,
        "expert_policy": args.expert_policy,
        "speculative": args.speculative,
        "draft_model": args.draft_model,
        "num_speculative_tokens": args.num_speculative_tokens,
    }


def _llm_from(args: argparse.Namespace):
    from moestream.llm import LLM

    return LLM(args.model, **llm_kwargs_from_args(args))


def _cmd_generate(args: argparse.Namespace) -> int:
    import time

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = _sampling_from(args)
    llm = _llm_from(args)
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    sys.stdout.write(prompt)
    sys.stdout.flush()
    start = time.perf_counter()
    n = 0
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta.delta_text)
        sys.stdout.flush()
        n += len(delta.new_token_ids)
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    print(f"[{n} tokens in {elapsed:.2f} s: {n / max(elapsed, 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling_from(args)
    llm = _llm_from(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Chat with the model; an empty line or Ctrl-D ends.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        reply = []
        for delta in llm.stream(prompt, params):
            sys.stdout.write(delta.delta_text)
            sys.stdout.flush()
            reply.append(delta.delta_text)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    import json

    from moestream.info import format_info, model_info

    info = model_info(args.model)
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    if args.gpu_expert_cache_gib is not None:
        from moestream.experts import ExpertBudgets, describe_placement, format_placement

        budgets = ExpertBudgets(args.gpu_expert_cache_gib, args.host_expert_cache_gib)
        placement = describe_placement(args.model, budgets, args.hit_rate)
        print(json.dumps(placement, indent=2) if args.json else format_placement(placement))
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from moestream.weights.convert import convert
    from moestream.weights.mixes import parse_layer_quant

    overrides = parse_layer_quant(args.layer_quant) if args.layer_quant else None
    out = convert(args.hf_dir, args.out, quant=args.quant, layer_quant=overrides)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


def _cmd_synth(args: argparse.Namespace) -> int:
    from moestream.weights.synth import synth_gguf

    out = synth_gguf(
        args.like,
        args.quant,
        args.out,
        n_layers=args.layers,
        n_experts=args.experts,
        seed=args.seed,
    )
    print(f"wrote {out} ({out.stat().st_size / 2**30:.2f} GiB)")
    return 0


def _decode_launches(model_path: str, device) -> set:
    """The launches that consult the launch-shape cache in one forward of a token through the
    model on `device` (`kernels.tuning.tracing`): every decode matmul's shape at one row."""
    import torch

    from moestream.kernels import tuning
    from moestream.layers.attention import AttentionMetadata
    from moestream.models.registry import build_model
    from moestream.weights.loader import open_model

    model = build_model(open_model(model_path), device, torch.bfloat16)
    ids = torch.zeros(1, dtype=torch.long, device=device)
    with tuning.tracing() as seen, torch.inference_mode():
        kv = model.make_kv_cache(1, 16)
        attn = AttentionMetadata.build([(0, 1, [0])], 16, device)
        model.compute_logits(model.forward(ids, ids.clone(), attn, kv))
    return seen


def _cmd_tune(args: argparse.Namespace) -> int:
    import torch

    from moestream.errors import RequestError
    from moestream.kernels import tuner, tuning

    if args.repeats < 1:
        raise RequestError(f"--repeats must be at least 1, got {args.repeats}")
    device = torch.device(args.device)
    timer = tuner.make_timer(device, args.repeats)  # no CUDA GPU: one clear error
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    shapes = tuner.widen(_decode_launches(args.model, device), args.batch_sizes)
    torch.cuda.empty_cache()  # the model is gone: room for the random operands
    tuner.compile_ahead(shapes, device, args.jobs)
    results = tuner.tune_shapes(shapes, device, timer)
    path = tuning.cache_path(args.cache_dir)
    tuning.write_cache(path, tuning.device_key(device), tuner.cache_entries(results))
    print(tuner.format_results(results))
    won = sum(r.best != r.default for r in results)
    print(f"{won} of {len(results)} launch shapes beat the default; wrote {path}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from moestream.server.app import serve

    return serve(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.command_line = ["moestream", *argv]  # recorded by bench and eval as the command run
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args) or 0
    except MoestreamError as e:
        if args.debug:
            raise
        print(f"moestream: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
