"""Replay a recorded agent-client session against `moestream serve`: prefix reuse and exactness.

Usage (repository root):
    python bench/agent_session.py [MODEL] [--max-tokens 16] [--json out.json]
    python bench/agent_session.py --url http://127.0.0.1:P --cold-url http://127.0.0.1:Q
    python bench/agent_session.py --write-session session.json   # the bundled session as JSON

A session is a JSON list of turns, `{"action": str, "messages": [...]}`: every chat request an
agent client sent, in order, with the whole conversation as the client sent it. The bundled one
is Cline-style: a system prompt that defines the tools in text, a task, assistant turns that call
tools in XML, tool results sent back as user messages with the editor's environment details, and
twice the client rewriting its last user message (refreshed environment details, a tool result
cut short) instead of appending. Prompts grow to about 3,000 tokens.

Each turn goes to the server (`--url`, prefix cache on) with the `openai` client, temperature 0,
and records prompt_tokens, usage.prompt_tokens_details.cached_tokens and the text. Then every
turn's prompt goes to a second server started with --no-prefix-caching (`--cold-url`), which
prefills it whole. Without --url the script starts both servers itself (`moestream serve MODEL`,
loopback, free ports) and stops them at the end.

Printed per turn: prompt tokens, reused (cached) tokens, % reused, reusable (the longest token
prefix shared with an earlier turn's prompt, in whole blocks, short of the last token), and
whether the text equals the cold run's. Exit status 1 if a text differs or a turn reused less
than it could.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "moestream" / "data" / "heldout-python.txt"
BLOCK_SIZE = 16  # the server's KV block: reuse is counted in whole blocks


# ---- the recorded session ----------------------------------------------------------------------
_TOOLS = """\
====
TOOL USE

You have access to a set of tools that are executed upon the user's approval. You can use one
tool per message, and will receive the result of that tool use in the user's response. You use
tools step-by-step to accomplish a given task, with each tool use informed by the result of the
previous tool use. Tool use is formatted using XML-style tags:

<tool_name>
<parameter1_name>value1</parameter1_name>
</tool_name>

# Tools

## read_file
Description: Request to read the contents of a file at the specified path. Use this when you
need to examine the contents of an existing file, for example to analyze code or review text.
Parameters:
- path: (required) The path of the file to read, relative to the working directory.
Usage:
<read_file>
<path>File path here</path>
</read_file>

## search_files
Description: Request to perform a regex search across files in a specified directory, giving
context-rich results: each match with the lines around it.
Parameters:
- path: (required) The directory to search in, recursively.
- regex: (required) The regular expression pattern to search for (Rust regex syntax).
- file_pattern: (optional) Glob pattern to filter files (for example '*.py').
Usage:
<search_files>
<path>Directory path here</path>
<regex>Your regex pattern here</regex>
<file_pattern>file pattern here (optional)</file_pattern>
</search_files>

## execute_command
Description: Request to execute a CLI command on the system. Tailor the command to the user's
system and explain what it does. Prefer complex commands over scripts.
Parameters:
- command: (required) The CLI command to execute.
- requires_approval: (required) true for commands with side effects, false for safe ones.
Usage:
<execute_command>
<command>Your command here</command>
<requires_approval>true or false</requires_approval>
</execute_command>

## replace_in_file
Description: Request to replace sections of content in an existing file using SEARCH/REPLACE
blocks that define exact changes to specific parts of the file.
Parameters:
- path: (required) The path of the file to modify.
- diff: (required) One or more SEARCH/REPLACE blocks:
  <<<<<<< SEARCH
  exact content to find
  =======
  new content to replace with
  >>>>>>> REPLACE
Usage:
<replace_in_file>
<path>File path here</path>
<diff>Search and replace blocks here</diff>
</replace_in_file>

## attempt_completion
Description: After each tool use the user responds with its result. Once you can confirm that
the task is complete, use this tool to present the result of your work to the user.
Parameters:
- result: (required) The result of the task, final and without a question.
Usage:
<attempt_completion>
<result>Your final result description here</result>
</attempt_completion>

====
RULES

- The current working directory is /home/dev/cpython: you cannot cd elsewhere.
- Do not ask for more information than necessary. Use the tools provided to accomplish the
  user's request efficiently and effectively.
- When you have completed the task, you must use the attempt_completion tool.
- Wait for the user's response after each tool use to confirm its success before going on.
"""

_SYSTEM = (
    "You are Cline (agent-session replay), a highly skilled software engineer with extensive "
    "knowledge in many programming languages, frameworks, design patterns and best practices.\n\n"
)


def _heldout_file(needle: str) -> str:
    """The document of the held-out file (separated by <|endoftext|>) that contains `needle`."""
    docs = [d.strip("\n") + "\n" for d in HELDOUT.read_text().split("<|endoftext|>")]
    return next(d for d in docs if needle in d)


def _env(time_s: str, tabs: list[str], note: str = "") -> str:
    lines = [
        "<environment_details>",
        "# VSCode Visible Files",
        tabs[0],
        "",
        "# VSCode Open Tabs",
        *tabs,
        "",
        "# Current Time",
        f"2026-11-29 {time_s} (UTC)",
    ]
    if note:
        lines += ["", note]
    return "\n".join(lines + ["</environment_details>"])


def _lines(text: str, n: int) -> str:
    return "\n".join(text.splitlines()[:n]) + "\n"


def build_session(small: bool = False) -> list[dict]:
    """The bundled Cline-style session: 8 turns (5 if `small`, with prompts short enough for
    a 256-token context). Deterministic: file contents come from heldout-python.txt."""
    atexit_py = _heldout_file("class GeneralTest(unittest.TestCase)")
    other_py = _heldout_file("class TestStructSeq(unittest.TestCase)")
    test_path, other_path = "Lib/test/_test_atexit.py", "Lib/test/_test_embed_structseq.py"
    tabs = [test_path, "Lib/atexit.py"]
    if small:
        system = "You are Cline (agent-session replay). Tools: read_file, execute_command.\n"
        task = "<task>Fix test_atexit.</task>\n"
        atexit_py = _lines(atexit_py, 4)
        env = lambda t, tabs, note="": f"<env>{t}{note[:12]}</env>"  # noqa: E731
        a_run = "<execute_command>pytest</execute_command>"
        run_output = "test_raise FAIL\n"
    else:
        system = _SYSTEM + _TOOLS
        task = (
            "<task>\nThe atexit tests fail on my branch after I changed how unraisable "
            "exceptions are reported. Find out why and fix it.\n</task>\n"
        )
        env = _env
        a_run = (
            "<execute_command>\n<command>python -m test test_atexit -v</command>\n"
            "<requires_approval>false</requires_approval>\n</execute_command>"
        )
        run_output = (
            "test_order (test.test_atexit.GeneralTest.test_order) ... ok\n"
            "test_raise (test.test_atexit.GeneralTest.test_raise) ... FAIL\n"
            "AssertionError: <class 'TypeError'> != <class 'ZeroDivisionError'>\n"
            "FAILED (failures=1)\n"
        )
    a_read = f"<read_file>\n<path>{test_path}</path>\n</read_file>"
    a_read2 = f"<read_file>\n<path>{other_path}</path>\n</read_file>"
    result = lambda tool, body: f"[{tool}] Result:\n{body}"  # noqa: E731

    msgs: list[dict] = [{"role": "system", "content": system}]
    turns: list[dict] = []

    def send(action: str) -> None:
        turns.append({"action": action, "messages": [dict(m) for m in msgs]})

    msgs.append({"role": "user", "content": task + env("10:00:01", tabs)})
    send("task")
    msgs += [
        {"role": "assistant", "content": a_read},
        {"role": "user", "content": result(f"read_file for '{test_path}'", atexit_py)
         + env("10:00:09", tabs)},
    ]  # fmt: skip
    send("append tool result (read_file)")
    msgs[-1] = {
        "role": "user",
        "content": result(f"read_file for '{test_path}'", atexit_py)
        + env("10:00:31", tabs[::-1], "# The user edited Lib/atexit.py since the last message"),
    }
    send("rewrite last message (environment)")
    msgs += [
        {"role": "assistant", "content": a_run},
        {"role": "user", "content": result("execute_command", run_output)
         + env("10:01:02", tabs)},
    ]  # fmt: skip
    send("append tool result (command)")
    if small:
        msgs[-1] = {
            "role": "user",
            "content": result("execute_command", run_output[:10] + " [cut]")
            + env("10:01:20", tabs),
        }
        send("rewrite last message (tool output cut)")
        return turns
    msgs += [
        {"role": "assistant", "content": a_read2},
        {"role": "user", "content": result(f"read_file for '{other_path}'", other_py)
         + env("10:01:40", tabs)},
    ]  # fmt: skip
    send("append tool result (read_file)")
    msgs[-1] = {
        "role": "user",
        "content": result(f"read_file for '{other_path}'", _lines(other_py, 30))
        + "[File truncated to its first 30 lines to save context.]\n"
        + env("10:02:05", tabs, "# The user added feedback: keep the public API unchanged."),
    }
    send("rewrite last message (tool output cut)")
    msgs += [
        {"role": "assistant", "content": (
            f"<replace_in_file>\n<path>{test_path}</path>\n<diff>\n<<<<<<< SEARCH\n"
            "            self.assertEqual(cm.unraisable.exc_type, exc_type)\n=======\n"
            "            self.assertIs(cm.unraisable.exc_type, exc_type)\n>>>>>>> REPLACE\n"
            "</diff>\n</replace_in_file>")},
        {"role": "user", "content": result(f"replace_in_file for '{test_path}'",
         f"The content was successfully saved to {test_path}.\n")
         + env("10:02:40", tabs)},
    ]  # fmt: skip
    send("append tool result (edit)")
    msgs += [
        {"role": "assistant", "content": a_run},
        {"role": "user", "content": result("execute_command",
         "Ran 9 tests in 0.412s\n\nOK\n") + env("10:03:02", tabs)},
    ]  # fmt: skip
    send("append tool result (command)")
    return turns


# ---- replay ------------------------------------------------------------------------------------
@dataclass
class TurnResult:
    turn: int
    action: str
    prompt_tokens: int
    cached_tokens: int
    reusable_tokens: int
    text: str
    cold_prompt_tokens: int = -1
    cold_cached_tokens: int = -1
    cold_text: str | None = None

    @property
    def identical(self) -> bool:
        return self.cold_text == self.text and self.cold_prompt_tokens == self.prompt_tokens

    @property
    def percent_reused(self) -> float:
        return 100.0 * self.cached_tokens / max(1, self.prompt_tokens)


def reusable_tokens(prompt: list[int], earlier: list[list[int]], block_size: int) -> int:
    """Tokens of `prompt` a prefix cache over whole blocks can serve from `earlier` prompts:
    the longest shared prefix, short of the last token (it must be computed), cut to blocks."""
    best = 0
    for other in earlier:
        n = 0
        for a, b in zip(prompt, other):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return min(best, len(prompt) - 1) // block_size * block_size


def _served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def _prompt_ids(url: str, model: str, messages: list[dict]) -> list[int]:
    """The prompt the chat endpoint builds, from the server's /tokenize (vLLM's shape)."""
    body = {"model": model, "messages": messages, "add_generation_prompt": True}
    r = httpx.post(f"{url}/tokenize", json=body, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def _chat(client, model: str, messages: list[dict], max_tokens: int) -> tuple[int, int, str]:
    r = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=max_tokens
    )
    details = r.usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else 0
    return r.usage.prompt_tokens, cached or 0, r.choices[0].message.content or ""


def replay(url: str, cold_url: str, session: list[dict], max_tokens: int = 16) -> list[TurnResult]:
    """Every turn against `url` in order, then every turn's prompt against `cold_url`."""
    import openai

    model, cold_model = _served_model(url), _served_model(cold_url)
    results: list[TurnResult] = []
    earlier: list[list[int]] = []
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        for i, turn in enumerate(session, 1):
            ids = _prompt_ids(url, model, turn["messages"])
            reusable = reusable_tokens(ids, earlier, BLOCK_SIZE)
            earlier.append(ids)
            n_prompt, cached, text = _chat(client, model, turn["messages"], max_tokens)
            if n_prompt != len(ids):
                raise RuntimeError(f"turn {i}: /tokenize gave {len(ids)} tokens, chat {n_prompt}")
            results.append(TurnResult(i, turn["action"], n_prompt, cached, reusable, text))
    with openai.OpenAI(base_url=f"{cold_url}/v1", api_key="none", max_retries=0) as cold:
        for r, turn in zip(results, session):
            n, cached, text = _chat(cold, cold_model, turn["messages"], max_tokens)
            r.cold_prompt_tokens, r.cold_cached_tokens, r.cold_text = n, cached, text
    return results


def table(results: list[TurnResult]) -> str:
    rows = [
        "| turn | client action | prompt tokens | reused tokens | % reused | reusable | "
        "identical to cold? |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        rows.append(
            f"| {r.turn} | {r.action} | {r.prompt_tokens} | {r.cached_tokens} | "
            f"{r.percent_reused:.1f} | {r.reusable_tokens} | {'yes' if r.identical else 'NO'} |"
        )
    total, reused = sum(r.prompt_tokens for r in results), sum(r.cached_tokens for r in results)
    rows.append(f"| all | | {total} | {reused} | {100 * reused / max(1, total):.1f} | | |")
    return "\n".join(rows)


def problems(results: list[TurnResult]) -> list[str]:
    """What the run shows wrong: texts that differ from cold, turns that reused too little,
    a cold server that reused anything."""
    out = []
    for r in results:
        if not r.identical:
            out.append(f"turn {r.turn}: {r.text!r} != cold {r.cold_text!r}")
        if r.cached_tokens < r.reusable_tokens:
            out.append(f"turn {r.turn}: reused {r.cached_tokens} of {r.reusable_tokens} tokens")
        if r.cold_cached_tokens != 0:
            out.append(f"turn {r.turn}: the cold server reused {r.cold_cached_tokens} tokens")
    return out


# ---- servers -----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def spawn_server(model: str, *extra: str, name: str = "agent-demo") -> Iterator[str]:
    """`moestream serve MODEL` on 127.0.0.1 and a free port; yields its URL, stops it after."""
    port = _free_port()
    cmd = [
        sys.executable, "-c", "import sys; from moestream.cli import main; sys.exit(main())",
        "serve", model, "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", name, *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {proc.stderr.read()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start within 120 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "model",
        nargs="?",
        default=os.environ.get("MOESTREAM_MODEL"),
        help="GGUF or HF folder to serve (default: the embedded demo model)",
    )
    p.add_argument("--url", default=None, help="a running server (prefix caching on)")
    p.add_argument("--cold-url", default=None, help="a running server with --no-prefix-caching")
    p.add_argument("--session", type=Path, default=None, help="session JSON (default: bundled)")
    p.add_argument("--write-session", type=Path, default=None, help="write the bundled session")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads of spawned servers")
    p.add_argument("--json", type=Path, default=None, help="write per-turn results here")
    args = p.parse_args(argv)
    if args.write_session is not None:
        args.write_session.write_text(json.dumps(build_session(), indent=1) + "\n")
        return 0
    session = json.loads(args.session.read_text()) if args.session else build_session()
    if (args.url is None) != (args.cold_url is None):
        p.error("give both --url and --cold-url, or neither")
    started = time.perf_counter()
    if args.url is not None:
        results = replay(args.url, args.cold_url, session, args.max_tokens)
    else:
        from moestream.cli import DEMO_MODEL

        model = args.model or str(DEMO_MODEL)
        common = ("--device", "cpu", "--threads", str(args.threads))
        with (
            spawn_server(model, *common) as url,
            spawn_server(model, *common, "--no-prefix-caching") as cold_url,
        ):
            results = replay(url, cold_url, session, args.max_tokens)
    print(table(results))
    print(f"({len(results)} turns, max_tokens {args.max_tokens}, "
          f"{time.perf_counter() - started:.1f} s)")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    bad = problems(results)
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
