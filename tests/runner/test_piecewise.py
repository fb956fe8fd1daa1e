"""Decode graphs cut at host points (runner/piecewise.py): the order a chain of graphs is
captured and replayed in (CPU, with a stand-in for torch's graphs), and on a GPU (marked) a
model with streamed experts decoding through chains of graphs with the eager steps' bits."""

from __future__ import annotations

import pytest
import torch

from moestream.cli import DEMO_MODEL
from moestream.runner import piecewise

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_chain_replays_its_pieces_and_hooks_in_capture_order(monkeypatch) -> None:
    log: list[str] = []
    made: list[object] = []

    class Graph:  # stands in for torch.cuda.CUDAGraph
        def __init__(self) -> None:
            self.n = len(made)
            made.append(self)

        def capture_begin(self, pool=None, capture_error_mode="global") -> None:
            assert pool == (1, 2) and capture_error_mode == "thread_local"
            log.append(f"begin{self.n}")

        def capture_end(self) -> None:
            log.append(f"end{self.n}")

        def replay(self) -> None:
            log.append(f"g{self.n}")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    cutter = piecewise.Cutter((1, 2))
    cutter.begin()
    for i in range(2):
        cutter.cut(lambda i=i: log.append(f"before{i}"), lambda i=i: log.append(f"after{i}"))
    cutter.finish()
    assert log == ["begin0", "end0", "begin1", "end1", "begin2", "end2"]
    log.clear()
    cutter.replay()
    assert log == ["g0", "before0", "g1", "after0", "before1", "g2", "after1"]


def test_no_cutter_outside_a_capture() -> None:
    assert piecewise.active() is None


@gpu
def test_streamed_decode_graphs_give_the_eager_bits() -> None:
    """Streamed experts at 5 of the demo's 8 experts a layer on the device: decode steps of one
    and two requests run as chains of graphs (3 requests, past the slots' limit, eagerly) and
    give the tokens and logprobs of the same model run eagerly."""
    from moestream.experts import ExpertLayout
    from moestream.llm import LLM
    from moestream.types import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    prompts = ["def fibonacci(n):\n", "import json\n\nclass Config:\n", "for i in range(9):"]
    probe = LLM(DEMO_MODEL, device="cpu")
    c = probe.config
    layout = ExpertLayout.from_gguf(probe.source.gguf, c.n_experts, c.n_experts_used)
    gib = 5 * layout.slot_bytes / 2**30

    def outputs(enforce_eager: bool):
        # the streamed store (paged would be the default where host RAM holds every expert)
        llm = LLM(DEMO_MODEL, device="cuda", gpu_expert_cache_gib=gib, host_expert_cache_gib=1.0,
                  enforce_eager=enforce_eager, enable_prefix_caching=False,
                  expert_paging=False)  # fmt: skip
        got = [llm.generate([p], params)[0] for p in prompts]
        got += llm.generate(prompts[:2], params) + llm.generate(prompts, params)
        return llm, [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in got]

    graphed, with_graphs = outputs(False)
    runner = graphed.engine.runner
    assert isinstance(runner.graphs.backend, piecewise.PiecewiseCudaGraphBackend)
    assert runner.graphs.buckets == (1, 2)
    assert runner.num_captured_graphs >= 2
    _, eager = outputs(True)
    assert with_graphs == eager
