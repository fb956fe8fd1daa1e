"""The disk tier: positional reads of whole experts, O_DIRECT, and clear errors for unreadable or
short reads, including one that happens in the middle of generation."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from moestream.cli import DEMO_MODEL
from moestream.config import CacheConfig, SchedConfig
from moestream.engine import Engine
from moestream.experts import (
    ExpertBudgets,
    ExpertFileReader,
    ExpertLayout,
    ExpertReadError,
    attach_expert_store,
    build_expert_store,
    defer_expert_tensors,
)
from moestream.experts.disk import drop_page_cache
from moestream.models.registry import build_model
from moestream.types import SamplingParams
from moestream.weights.loader import open_model

DEMO = DEMO_MODEL
GIB = 2**30


def layout_of(source) -> ExpertLayout:
    c = source.config
    return ExpertLayout.from_gguf(source.gguf, c.n_experts, c.n_experts_used)


def expert_buffers(layout: ExpertLayout, layer: int) -> list[torch.Tensor]:
    return [torch.empty(t.expert_bytes, dtype=torch.uint8) for t in layout.layers[layer]]


@pytest.mark.parametrize("direct", [False, True])
def test_reads_match_the_file(source, tmp_path: Path, direct: bool) -> None:
    path = tmp_path / "m.gguf"  # a real disk (not tmpfs) when the test dir is one
    shutil.copy(DEMO, path)
    layout = layout_of(source)
    with ExpertFileReader(layout, path, direct=direct) as reader:
        if direct and not reader.direct_active:
            pytest.skip("this filesystem refuses O_DIRECT")
        for layer in (0, 2, layout.n_layers - 1):  # layers 2 and 5 have Q6_K down
            names = [t.name for t in layout.layers[layer]]
            stacks = [source.tensors[n].data.reshape(layout.n_experts, -1) for n in names]
            for e in range(layout.n_experts):
                out = expert_buffers(layout, layer)
                n = reader.read_expert(layer, e, out)
                assert n == layout.expert_bytes(layer)
                for got, stack in zip(out, stacks, strict=True):
                    assert torch.equal(got, stack[e])
        reader.will_need(1, [0, 3])  # a hint only: must not fail


def test_short_read_names_file_layer_and_expert(source, tmp_path: Path) -> None:
    layout = layout_of(source)
    cut = tmp_path / "cut.gguf"
    shutil.copy(DEMO, cut)
    t = layout.layers[3][2]  # blk.3.ffn_down_exps
    with open(cut, "r+b") as f:
        f.truncate(t.offset(5) + 100)  # expert 5 of layer 3 cut short, 6 and 7 gone
    with ExpertFileReader(layout, cut) as reader:
        reader.read_expert(3, 4, expert_buffers(layout, 3))  # before the cut: fine
        for e in (5, 7):
            with pytest.raises(ExpertReadError) as info:
                reader.read_expert(3, e, expert_buffers(layout, 3))
            msg = str(info.value)
            assert str(cut) in msg and f"expert {e} of layer 3" in msg
            assert "blk.3.ffn_down_exps.weight" in msg and "short read" in msg


def test_unreadable_file_is_an_expert_read_error(source, tmp_path: Path) -> None:
    layout = layout_of(source)
    with pytest.raises(ExpertReadError, match="cannot open"):
        ExpertFileReader(layout, tmp_path / "missing.gguf")
    reader = ExpertFileReader(layout, tmp_path)  # a directory: open works, reads fail
    with reader, pytest.raises(ExpertReadError, match=r"cannot read expert 1 of layer 0"):
        reader.read_expert(0, 1, expert_buffers(layout, 0))


def test_file_cut_during_generation_fails_the_step_then_recovers(source, tmp_path: Path) -> None:
    """Experts are streamed from a copy of the file; the copy is cut while the engine runs.
    The step that needs a lost expert raises ExpertReadError (no crash, no zeros); once the
    file is whole again the same request gives the resident model's tokens."""
    copy = tmp_path / "copy.gguf"
    shutil.copy(DEMO, copy)
    layout = layout_of(source)
    budget = layout.top_k * sum(layout.expert_bytes(i) for i in range(layout.n_layers))
    store = build_expert_store(
        open_model(copy), source.config, ExpertBudgets(budget / GIB), io_threads=2
    )
    model = build_model(defer_expert_tensors(source))  # dense weights from the intact file
    attach_expert_store(model, store)
    ref_model = build_model(source)
    tok = source.tokenizer()
    prompt = tok.encode("import os\nimport sys\n\ndef main(argv):\n")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def engine_for(m):
        return Engine(m, tok, CacheConfig(enable_prefix_caching=False), SchedConfig())

    ref = engine_for(ref_model)
    rid = ref.add_request(prompt, params)
    want = []
    while ref.has_unfinished():
        want += [t for o in ref.step() if o.request_id == rid for t in o.new_token_ids]

    first = layout.layers[0][0].data_offset
    with open(copy, "r+b") as f:
        f.truncate(first + 1000)  # every expert but part of layer 0's first gate is gone
    engine = engine_for(model)
    rid = engine.add_request(prompt, params)
    with pytest.raises(ExpertReadError) as info:
        while engine.has_unfinished():
            engine.step()
    assert str(copy) in str(info.value) and "short read" in str(info.value)
    assert store.counters["read_errors"] >= 1
    store.check()  # failed loads left no half-filled slot mapped
    engine.abort(rid)

    shutil.copy(DEMO, copy)  # same inode, whole again
    engine = engine_for(model)
    rid = engine.add_request(prompt, params)
    got = []
    while engine.has_unfinished():
        got += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    assert got == want
    store.check()
    store.close()


def test_failed_prefetch_is_counted_then_reported_on_demand(source, tmp_path: Path) -> None:
    """A prefetch that cannot read leaves no slot mapped; the forward that then needs the
    expert reads again and raises; once the file is whole the same call serves the expert."""
    copy = tmp_path / "copy.gguf"
    shutil.copy(DEMO, copy)
    layout = layout_of(source)
    per_slot = sum(layout.expert_bytes(i) for i in range(layout.n_layers))
    budgets = ExpertBudgets(3 * per_slot / GIB, 2 * per_slot / GIB)  # host tier on the path
    with build_expert_store(open_model(copy), source.config, budgets) as store:
        with open(copy, "r+b") as f:
            f.truncate(layout.layers[3][0].offset(5))  # layer 3's expert 5 onwards is gone
        assert store.prefetch(3, [5, 6]) == 2
        store.drain()
        assert store.counters["read_errors"] == 2 and store.counters["prefetch_issued"] == 0
        store.check()
        assert not store.device_tiers[3].dir.is_mapped(5)
        with pytest.raises(ExpertReadError, match=r"expert 5 of layer 3"):
            store.layers[3].weights(5)
        shutil.copy(DEMO, copy)
        gate, up, down = store.layers[3].weights(5)
        assert torch.equal(down.data, source.tensors["blk.3.ffn_down_exps.weight"].data[5])
        store.layers[3].end()
        store.check()


def resident_pages(path: Path) -> int:
    """Pages of `path` in the page cache (mincore over a fresh, untouched private mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            anchor = ctypes.c_char.from_buffer(mm)  # the mapping's address, no page touched
            vec = (ctypes.c_ubyte * pages)()
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), size, vec)
            del anchor
            if rc != 0:
                pytest.skip(f"mincore failed (errno {ctypes.get_errno()})")
        finally:
            mm.close()
    return sum(v & 1 for v in vec)


def filesystem_of(path: Path) -> str:
    """The type of the filesystem `path` lives on (longest mount point of /proc/mounts)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, fs, *_ = line.split()
        if str(path).startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
            best, kind = mount, fs
    return kind


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise")
def test_drop_page_cache_evicts_the_files_pages(tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(1 << 20))
    with open(path, "rb") as f:
        os.fsync(f.fileno())  # only clean pages can be dropped
        f.read()
    if filesystem_of(path) in ("tmpfs", "ramfs", "overlay", ""):
        pytest.skip("the page cache of this filesystem is its storage")
    before = resident_pages(path)
    if before == 0:
        pytest.skip("the file's pages were never cached here")
    assert drop_page_cache(path) is True
    assert resident_pages(path) < before // 4
    with pytest.raises(ExpertReadError, match="missing.gguf: cannot open"):
        drop_page_cache(tmp_path / "missing.gguf")


def test_llm_direct_io_reaches_the_reader_and_needs_streamed_experts(source, monkeypatch) -> None:
    """`LLM(expert_direct_io=True)` (`--expert-direct-io`) opens the store's reader with
    O_DIRECT and keeps the text of resident experts; without streamed experts it is refused."""
    from moestream.errors import RequestError
    from moestream.experts import store as store_module
    from moestream.llm import LLM

    asked: list[bool] = []

    class Recording(ExpertFileReader):
        def __init__(self, layout, path=None, direct=False):
            asked.append(direct)
            super().__init__(layout, path, direct)

    monkeypatch.setattr(store_module, "ExpertFileReader", Recording)
    layout = layout_of(source)
    per_slot = sum(layout.expert_bytes(i) for i in range(layout.n_layers))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = ["def fibonacci(n):\n"]
    want = LLM(DEMO, device="cpu").generate(prompt, greedy)[0].token_ids
    llm = LLM(DEMO, device="cpu", gpu_expert_cache_gib=3 * per_slot / GIB, expert_direct_io=True)
    try:
        assert asked == [True]
        assert llm.generate(prompt, greedy)[0].token_ids == want
        assert llm.expert_store.counters.snapshot()["bytes_from_disk"] > 0
    finally:
        llm.expert_store.close()
    with pytest.raises(RequestError, match="expert_direct_io needs streamed experts"):
        LLM(DEMO, device="cpu", expert_direct_io=True)
