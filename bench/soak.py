"""Bounded soak of `moestream serve` on loopback.

Usage (repository root):
    python bench/soak.py [MODEL] [--requests 2000] [--concurrency 64] [--abort-fraction 0.1]
                         [--max-tokens 64] [--url http://127.0.0.1:PORT] [--json out.json]

Without --url it serves MODEL (default: the embedded demo model) in this process on 127.0.0.1
and a free port. It sends a warm-up of `--concurrency` requests, reads the server's resident
memory (baseline), then `--requests` requests, `--concurrency` at a time: chat or completions,
streamed or not, random prompt lengths and max_tokens, and `--abort-fraction` of the streamed
ones closed mid-stream by the client. Then it waits for the engine to go idle and checks:
no 5xx answer, no request failed, every KV block back in the pool (`moestream_kv_blocks_used`
is 0), resident memory within `--rss-slack-mib` of the baseline. It prints (and with --json
writes) the latency percentiles: time to first token, inter-token latency, end to end.
Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

WORDS = [
    "def",
    "class",
    "return",
    "import",
    "self",
    "value",
    "list",
    "dict",
    "for",
    "while",
    "if",
    "else",
    "try",
    "yield",
    "async",
]


@dataclass
class SoakResult:
    requests: int = 0
    completed: int = 0
    aborted: int = 0
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    tokens: int = 0
    elapsed: float = 0.0

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    def summary(self) -> dict:
        def pct(xs: list[float]) -> dict:
            if not xs:
                return {}
            q = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else xs * 99
            return {"p50": q[49], "p90": q[89], "p99": q[98], "max": max(xs), "n": len(xs)}

        return {
            "requests": self.requests,
            "completed": self.completed,
            "aborted_by_client": self.aborted,
            "statuses": dict(sorted(self.statuses.items())),
            "failures": self.failures[:10],
            "tokens": self.tokens,
            "elapsed_s": self.elapsed,
            "ttft_s": pct(self.ttft),
            "itl_s": pct(self.itl),
            "e2e_s": pct(self.e2e),
        }


async def _one(
    client: httpx.AsyncClient, model: str, rng: random.Random, abort: bool, max_tokens: int,
    max_words: int, res: SoakResult,
) -> None:  # fmt: skip
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))
    stream = abort or rng.random() < 0.7
    body: dict = {
        "model": model,
        "max_tokens": rng.randint(1, max_tokens),
        "stream": stream,
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "seed": rng.randint(0, 10**6),
    }
    if rng.random() < 0.5:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": words}]
    else:
        path, body["prompt"] = "/v1/completions", words
    start = time.perf_counter()
    if not stream:
        r = await client.post(path, json=body)
        res.statuses[r.status_code] += 1
        if r.status_code == 200:
            res.completed += 1
            res.e2e.append(time.perf_counter() - start)
            res.tokens += r.json()["usage"]["completion_tokens"]
        else:
            res.failures.append(f"{r.status_code}: {r.text[:200]}")
        return
    cut_after = rng.randint(1, 4) if abort else None
    async with client.stream("POST", path, json=body) as r:
        res.statuses[r.status_code] += 1
        if r.status_code != 200:
            res.failures.append(f"{r.status_code}: {(await r.aread())[:200]!r}")
            return
        last, chunks = None, 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                res.completed += 1
                res.e2e.append(time.perf_counter() - start)
                return
            event = json.loads(line[6:])
            if "error" in event:
                res.failures.append(f"stream error: {event['error']['message'][:200]}")
                return
            now = time.perf_counter()
            if event["choices"]:
                res.tokens += 1
                if last is None:
                    res.ttft.append(now - start)
                else:
                    res.itl.append(now - last)
                last = now
            chunks += 1
            if cut_after is not None and chunks >= cut_after:
                res.aborted += 1
                return  # leaving the block closes the connection mid-stream
        res.failures.append("stream ended without [DONE]")


async def run_soak(
    base_url: str, model: str, *, requests: int, concurrency: int, abort_fraction: float,
    max_tokens: int = 64, max_words: int = 120, seed: int = 0, timeout: float = 600.0,
) -> SoakResult:  # fmt: skip
    """Send `requests` requests, `concurrency` at a time; see the module docstring."""
    rng = random.Random(seed)
    res = SoakResult(requests=requests)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:

        async def task(i: int) -> None:
            local = random.Random(rng.random())
            async with gate:
                try:
                    abort = local.random() < abort_fraction
                    await _one(client, model, local, abort, max_tokens, max_words, res)
                except httpx.HTTPError as e:
                    res.failures.append(f"request {i}: {type(e).__name__}: {e}")

        start = time.perf_counter()
        await asyncio.gather(*(task(i) for i in range(requests)))
        res.elapsed = time.perf_counter() - start
    return res


def read_metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(base_url: str, timeout: float = 30.0) -> dict[str, float]:
    """Metrics once no request runs or waits and no KV block is held (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(base_url)
        idle = m.get("moestream_num_requests_running", 1) == 0
        idle = idle and m.get("moestream_num_requests_waiting", 1) == 0
        if (idle and m.get("moestream_kv_blocks_used", 1) == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def _serve_in_thread(model: str):
    import uvicorn

    from moestream.llm import LLM
    from moestream.server.app import build_app, model_names
    from moestream.server.serving import ServerConfig

    llm = LLM(model)
    names = model_names(model, None)
    config = uvicorn.Config(
        build_app(llm, ServerConfig(model_names=names, max_concurrency=256, max_queue=4096)),
        host="127.0.0.1", port=0, log_level="warning",
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}", names[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None, help="GGUF or HF folder (default: demo)")
    p.add_argument("--url", default=None, help="soak a running server instead (loopback)")
    p.add_argument("--served-model-name", default=None, help="model name with --url")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--abort-fraction", type=float, default=0.1)
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens drawn from 1..this")
    p.add_argument("--max-words", type=int, default=120, help="prompt words drawn from 1..this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-slack-mib", type=float, default=64.0)
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads of the server")
    args = p.parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)

    server = thread = None
    if args.url:
        url, name = args.url.rstrip("/"), args.served_model_name
        if name is None:
            name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    else:
        from moestream.cli import DEMO_MODEL

        server, thread, url, name = _serve_in_thread(args.model or str(DEMO_MODEL))
    try:
        kw = dict(
            max_tokens=args.max_tokens, max_words=args.max_words, abort_fraction=args.abort_fraction
        )
        asyncio.run(run_soak(url, name, requests=args.concurrency, concurrency=args.concurrency,
                             seed=args.seed + 1, **kw))  # fmt: skip
        base = wait_idle(url)
        result = asyncio.run(
            run_soak(url, name, requests=args.requests, concurrency=args.concurrency,
                     seed=args.seed, **kw)
        )  # fmt: skip
        after = wait_idle(url)
    finally:
        if server is not None:
            server.should_exit = True
            thread.join(timeout=60)
    rss0 = base.get("process_resident_memory_bytes", 0) / 2**20
    rss1 = after.get("process_resident_memory_bytes", 0) / 2**20
    summary = result.summary() | {
        "kv_blocks_used_after": after.get("moestream_kv_blocks_used"),
        "kv_blocks_total": after.get("moestream_kv_blocks_total"),
        "rss_baseline_mib": rss0,
        "rss_after_mib": rss1,
        "concurrency": args.concurrency,
        "abort_fraction": args.abort_fraction,
    }
    checks = {
        "no 5xx": result.server_errors == 0,
        "no failed request": not result.failures,
        "every KV block back": after.get("moestream_kv_blocks_used") == 0,
        f"RSS within {args.rss_slack_mib} MiB of baseline": rss1 - rss0 <= args.rss_slack_mib,
    }
    summary["checks"] = checks
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
