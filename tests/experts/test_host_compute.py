"""Experts computed by the host's cores under zero-copy placement (`experts.host_compute`): the
layer's output has the bits of every expert on the device, whichever experts the host computed
(before and after a promotion moves the marks), and the counters add up. Under the Triton
interpreter with the exact float operations of the GPU (`kernels.exact.exact_interpreter`)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from moestream import native

pytest.importorskip("triton", reason="triton is not installed")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs the kernels on CPU tensors (TRITON_INTERPRET=1)", allow_module_level=True)
try:
    native.library()
except native.NativeUnavailable as exc:
    pytest.skip(f"native experts unavailable: {exc}", allow_module_level=True)

from moestream.errors import UnsupportedError  # noqa: E402
from moestream.experts.host_compute import HostCompute, default_threads  # noqa: E402
from moestream.experts.zero_copy import (  # noqa: E402
    STAGE_MIN_TOKENS,
    ExpertStage,
    ZeroCopyExperts,
    zero_copy_metric_families,
    zero_copy_snapshot,
)
from moestream.kernels.exact import exact_interpreter  # noqa: E402
from moestream.kernels.moe import fused_moe  # noqa: E402
from moestream.kernels.moe_mmvq import HYBRID_CONFIG  # noqa: E402
from moestream.weights.qtensor import QTensor  # noqa: E402
from moestream.weights.quantize import quantize  # noqa: E402

E, F, H, K = 4, 256, 256, 2


def stacks(seed: int) -> list[QTensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for qtype, shape in ((T.Q4_K, (E, F, H)), (T.Q4_K, (E, F, H)), (T.Q6_K, (E, H, F))):
        values = torch.randn(shape, generator=g) * 0.05
        out.append(QTensor(torch.from_numpy(quantize(values, qtype)), qtype, shape))
    return out


def hybrid(layer: ZeroCopyExperts, x, ids, weights) -> torch.Tensor:
    """The layer's experts as `ops.moe_forward_addr` launches them for one chunk on the GPU."""
    return fused_moe(x, ids, weights, *layer.stacked(), layer.host_marks, method="mmvq",
                     mmvq_cfg=HYBRID_CONFIG, expert_addr=layer.expert_addr,
                     host_rows=layer.host_work)  # fmt: skip


def test_host_computed_experts_keep_the_bits_of_every_expert_on_the_device() -> None:
    gate, up, down = stacks(3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, H, generator=g)  # two tokens: every expert once (the interpreter is slow)
    ids = torch.tensor([[1, 0], [3, 2]])
    weights = torch.softmax(torch.randn(2, K, generator=g), dim=-1)
    compute = HostCompute(torch.device("cpu"), threads=2)
    # expert 0 on the device; host slots 0, 1 (experts 1, 2) computed by the host; 3 by link
    layer = ZeroCopyExperts([gate, up, down], 1, "cpu", n_cpu=2, compute=compute)
    assert layer.host_marked.tolist() == [0, 1, 1, 0]
    assert layer.fully_resident  # host work runs in the stream: CUDA graphs stay on
    slots = torch.arange(E, dtype=torch.int32)
    with exact_interpreter():
        want = fused_moe(x, ids, weights, gate, up, down, slots, method="mmvq",
                         mmvq_cfg=HYBRID_CONFIG)  # fmt: skip
        got = hybrid(layer, x, ids, weights)
        assert compute.counters["assignments"] == 2  # ids 1, 2
        assert compute.counters["bytes"] == 2 * layer.expert_bytes
        layer._swap(0, 1)  # a promotion: 1 to the device, 0 to its host slot (and its mark)
        assert layer.host_marked.tolist() == [1, 0, 1, 0]
        after = hybrid(layer, x, ids, weights)
        assert compute.counters["assignments"] == 2 + 2  # ids 0, 2
        layer.observe(ids)
        assert layer.read_counts() == {"device": 1, "host": 1, "cpu": 2, "stage": 0}
        layer.set_cpu_slots(3)  # every host slot the host's (experts 0, 2, 3); fewer threads
        compute.set_threads(1)
        assert layer.host_marked.tolist() == [1, 0, 1, 1]
        assert layer.host_marks.tolist() == [-1, 0, -1, -1]
        assert {args.threads for args in layer.host_work.launch_args()} == {1}
        remarked = hybrid(layer, x, ids, weights)
        assert compute.counters["assignments"] == 4 + 3  # ids 0, 3, 2 (1 on the device)
        # a long forward's launch reads the host tier from a prefill stage, with no host work
        # (`layers.moe.SparseMoE.forward_routed`; its output: test_zero_copy's stage test, and
        # with host experts marked, test_host_compute_gpu's)
        layer.attach_stage(ExpertStage([w.data.numel() for w in layer._host], torch.device("cpu")))
        addr, on_stage = layer.addresses(STAGE_MIN_TOKENS)
        assert on_stage and not torch.equal(addr, layer.expert_addr)
        assert compute.counters["assignments"] == 7
    assert np.abs(want.numpy()).max() > 0
    for out in (got, after, remarked):
        assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    with pytest.raises(ValueError, match="n_cpu"):
        layer.set_cpu_slots(4)


class Shifted:
    """A layer's host work whose rows are off by one: the kernels must add them."""

    def __init__(self, work):
        self.work = work

    def begin(self, *args) -> None:
        self.work.begin(*args)

    def rows(self) -> torch.Tensor:
        return self.work.rows() + 1.0


def test_the_kernels_add_the_hosts_rows_for_marked_experts_only() -> None:
    gate, up, down = stacks(6)
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(7))
    ids = torch.tensor([[1], [3]])  # token 0's expert is the host's (1), token 1's is not
    weights = torch.ones(2, 1)  # (one expert a token: half the interpreter's time of two)
    layer = ZeroCopyExperts([gate, up, down], 1, "cpu", n_cpu=1,
                            compute=HostCompute(torch.device("cpu"), threads=1))  # fmt: skip
    with exact_interpreter():
        exact = hybrid(layer, x, ids, weights)
        layer.host_work = Shifted(layer.host_work)
        shifted = hybrid(layer, x, ids, weights)
    assert torch.allclose(shifted[0], exact[0] + 1.0)
    assert torch.equal(shifted[1], exact[1])


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 2), (7, 7), (8, 7), (16, 15)])
def test_default_threads_leave_a_core_from_eight(monkeypatch, cores: int, threads: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert default_threads() == threads
    assert HostCompute(torch.device("cpu"), poll=False).threads == threads


def test_host_computed_experts_need_the_types_the_native_code_reads() -> None:
    gate, up, down = stacks(5)
    q8 = QTensor(torch.from_numpy(quantize(torch.randn(E, F, H) * 0.05, T.Q8_0)), T.Q8_0,
                 (E, F, H))  # fmt: skip
    compute = HostCompute(torch.device("cpu"), threads=1)
    with pytest.raises(UnsupportedError, match="Q4_K"):
        ZeroCopyExperts([q8, up, down], 1, "cpu", n_cpu=1, compute=compute)
    with pytest.raises(ValueError, match="n_cpu"):
        ZeroCopyExperts([gate, up, down], 2, "cpu", n_cpu=3, compute=compute)
    with pytest.raises(ValueError, match="threads"):
        HostCompute(torch.device("cpu"), threads=0)


def test_poll_mode_gives_the_host_functions_rows_and_reports_a_post_of_no_job() -> None:
    """Poll mode (a thread of the native code answers the kernels' posts instead of a CUDA host
    function): a layer's host rows equal those of the host function, bit for bit, twice (the
    second post of the same job a new sequence number); a post naming no job is answered and
    counted, and `counters` raise."""
    from moestream.experts.host_compute import POLL_JOBS
    from moestream.kernels.mmvq import quantize_q8

    gate, up, down = stacks(3)
    g = torch.Generator().manual_seed(4)
    xa = quantize_q8(torch.randn(3, H, generator=g))
    ids = torch.tensor([[1, 0], [3, 2], [2, 1]])
    weights = torch.softmax(torch.randn(3, K, generator=g), dim=-1)
    rows = []
    for poll in (False, True, True):
        compute = HostCompute(torch.device("cpu"), threads=2, poll=poll)
        layer = ZeroCopyExperts([gate, up, down], 1, "cpu", n_cpu=2, compute=compute)
        marked = torch.from_numpy(layer.host_marked[ids.flatten().numpy()] != 0)  # 0, 3-5
        layer.host_work.begin(ids, weights, xa)
        rows.append(layer.host_work.rows()[marked].clone())
        if poll:
            layer.host_work.begin(ids, weights, xa)
            assert torch.equal(layer.host_work.rows()[marked], rows[-1])
            assert compute._poller.jobs == 2 and compute.counters["assignments"] == 8
    # one compute switched both ways (`set_poll`, benchmarks' side-by-side arms): the same rows
    for poll in (False, True):
        compute.set_poll(poll)
        layer.host_work.begin(ids, weights, xa)
        rows.append(layer.host_work.rows()[marked].clone())
    assert compute._poller.jobs == 3
    assert marked.sum() == 4 and rows[0].abs().max() > 0
    for got in rows[1:]:
        assert torch.equal(got.view(torch.int32), rows[0].view(torch.int32))
    compute.post_and_wait(POLL_JOBS - 1)  # an empty table entry
    counted = compute.counters  # a metrics read sees the failure and leaves it to the step
    assert counted["poll_bad_posts"] == 1 and counted["poll_timeouts"] == 0
    families = {name: value for name, _, _, value in zero_copy_metric_families(
        zero_copy_snapshot([layer]))}  # fmt: skip
    assert families["moestream_expert_zero_copy_cpu_poll_bad_posts"] == 1
    assert families["moestream_expert_zero_copy_cpu_poll_timeouts"] == 0
    with pytest.raises(RuntimeError, match="1 posts named no job, 0 waits for the host's rows"):
        compute.check()
    compute.check()  # reported once: later steps run again
    assert compute.counters["poll_bad_posts"] == 0
