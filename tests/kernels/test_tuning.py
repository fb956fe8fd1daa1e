"""The launch-shape cache (`kernels.tuning`): its file round trip and failure modes, the lookups
the kernels' config functions make, the tuner with a fake timer (it keeps only candidates with
the default's bits), and a model's logits with and without a populated cache. Without CUDA the
kernels run in the Triton interpreter on the CPU, whose device key is "cpu triton X.Y.Z"."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

pytest.importorskip("triton", reason="triton is not installed")

from gguf import GGMLQuantizationType  # noqa: E402

from moestream.kernels import tuner, tuning  # noqa: E402
from moestream.kernels._triton_dequant import num_sms  # noqa: E402
from moestream.kernels.mmvq import MmvqConfig, mmvq_config  # noqa: E402
from moestream.kernels.tuning import DenseShape, MoeShape, PairShape  # noqa: E402

T = GGMLQuantizationType
DEV = torch.device(DEVICE, 0) if DEVICE == "cuda" else torch.device("cpu")
SMS = 132
SHAPE = DenseShape("Q4_K", 6144, 4096, 1)  # Qwen3-8B's q/k/v at M = 1


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch) -> Path:
    """A fresh cache folder for each test, read afresh (and forgotten after it)."""
    monkeypatch.setenv("MOESTREAM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MOESTREAM_TUNE_CACHE", raising=False)
    tuning.reset()
    yield tmp_path
    tuning.reset()


def entry(knobs: dict, base) -> dict:
    return {"config": knobs, "base": tuning.config_dict(base), "us": 1.0, "default_us": 2.0}


def write(entries: dict, device: str | None = None) -> Path:
    path = tuning.cache_path()
    tuning.write_cache(path, device or tuning.device_key(DEV), entries)
    tuning.reset()
    return path


def config_of(shape: DenseShape = SHAPE) -> MmvqConfig:
    qtype, padded = tuning.parse_label(shape.weight)
    return mmvq_config(shape.n, shape.k, SMS, shape.m_block, "once", padded, qtype, DEV)


def default_of(shape: DenseShape = SHAPE) -> MmvqConfig:
    padded = tuning.parse_label(shape.weight)[1]
    return mmvq_config(shape.n, shape.k, SMS, shape.m_block, "once", padded)


def test_cache_round_trip_keeps_other_entries_and_drops_none(cache_dir: Path) -> None:
    base = default_of()
    other = DenseShape("Q6_K/padded", 151936, 2048, 1)
    path = write({"mmvq": {SHAPE.key: entry({"block_n": 8, "num_warps": 2}, base)}})
    write({"mmvq": {other.key: entry({"block_n": 8, "num_warps": 4}, default_of(other))}})
    assert path == cache_dir / "launch-shapes.json"
    assert not [p for p in cache_dir.iterdir() if p.name != path.name]  # no temporary file left
    devices = tuning.read_cache(path)
    assert set(devices[tuning.device_key(DEV)]["mmvq"]) == {SHAPE.key, other.key}
    assert config_of() == base._replace(block_n=8, num_warps=2)
    assert config_of(other) == default_of(other)._replace(block_n=8, num_warps=4)
    write({"mmvq": {SHAPE.key: None}})  # re-tuned, the default won: the entry goes
    assert config_of() == base and config_of(other) != default_of(other)


@pytest.mark.parametrize("text", ["{not json", '{"format": 99, "devices": {}}', "[1, 2]"])
def test_corrupt_file_gives_the_defaults_and_one_warning(text: str) -> None:
    tuning.cache_path().write_text(text)
    with pytest.warns(RuntimeWarning, match="launch-shape cache") as seen:
        assert config_of() == default_of()
        assert config_of(SHAPE._replace(m_block=2)) == default_of(SHAPE._replace(m_block=2))
    assert len(seen) == 1  # read once per process


def test_other_device_or_triton_version_gives_the_defaults() -> None:
    knobs = {"block_n": 8, "num_warps": 2}
    name = tuning.device_key(DEV).rsplit(" triton ", 1)[0]
    write({"mmvq": {SHAPE.key: entry(knobs, default_of())}}, f"{name} triton 0.0.1")
    write({"mmvq": {SHAPE.key: entry(knobs, default_of())}}, "NVIDIA B200 sm_100 triton 3.6.0")
    assert config_of() == default_of()
    write({"mmvq": {SHAPE.key: entry(knobs, default_of())}})
    assert config_of() == default_of()._replace(block_n=8, num_warps=2)


def test_mmvq_config_takes_a_cached_shape_else_the_default(monkeypatch) -> None:
    base = default_of()
    small = [DenseShape("Q4_K", n, 256, 1) for n in range(1, 7)]
    own = [default_of(s) for s in small]
    knobs = {"block_n": 8, "num_warps": 2}
    entries = {  # not valid configs for their shapes: ignored
        small[0].key: entry({"block_n": 3, "num_warps": 2}, own[0]),
        small[1].key: entry({**knobs, "groups": 2}, own[1]),
        small[2].key: entry({"block_n": 8, "num_warps": True}, own[2]),
        small[3].key: entry(knobs, own[3]._replace(split_k=2)),  # tuned against another default
        small[4].key: "block_n=8",
        small[5].key: entry(knobs, own[5]),  # valid
        SHAPE.key: entry({"block_n": 16, "num_warps": 4}, base),
    }
    write({"mmvq": entries})
    tuned = config_of()
    assert tuned == base._replace(block_n=16, num_warps=4)
    assert (tuned.split_k, tuned.groups) == (base.split_k, base.groups)  # these fix the bits
    assert config_of() is tuned  # memoized
    assert [config_of(s) for s in small] == [*own[:5], own[5]._replace(**knobs)]
    assert config_of(SHAPE._replace(m_block=2)) == default_of(SHAPE._replace(m_block=2))
    assert config_of(SHAPE._replace(weight="Q6_K")) == default_of(SHAPE._replace(weight="Q6_K"))
    assert mmvq_config(6144, 4096, SMS, 1, "once") == base  # no type or device: the default
    monkeypatch.setenv("MOESTREAM_TUNE_CACHE", "off")
    tuning.reset()
    assert config_of() == base


def test_candidates_change_only_rows_and_warps_within_the_limits() -> None:
    from moestream.kernels.mmvq_once import once_warps
    from moestream.kernels.moe_mmvq import DEFAULT_CONFIG

    for shape in (SHAPE, SHAPE._replace(m_block=2), DenseShape("Q8_0", 4096, 12288, 8)):
        base = default_of(shape)
        cands = tuner.candidates(shape, base)
        assert cands and len(set(cands)) == len(cands) and base not in cands
        sub = 8 if shape.weight == "Q8_0" else 4
        for c in cands:
            assert c._replace(block_n=base.block_n, num_warps=base.num_warps) == base
            assert once_warps(c, sub) == c.num_warps  # no warp count launched as another
            if shape.m_block > 1:  # one warp spills from M = 2: never fewer than the default
                assert c.num_warps >= once_warps(base, sub)
    moe = MoeShape("Q4_K", "Q4_K", "Q6_K/padded", 2048, 768, 8, 1)
    cands = tuner.candidates(moe, DEFAULT_CONFIG)
    assert cands and DEFAULT_CONFIG not in cands
    for c in cands:
        assert tuning.with_knobs(c, {"up_block_n": 4, "up_warps": 1}) == DEFAULT_CONFIG


def test_widen_keeps_the_batch_sizes_each_kernel_serves() -> None:
    shapes = {
        DenseShape("Q4_K", 512, 256, 1),
        DenseShape("IQ4_NL", 512, 256, 1),  # a code type: mmvq up to 8 rows
        PairShape("Q4_K", "Q6_K/padded", 512, 128, 256, 1),
        MoeShape("Q4_K", "Q4_K", "Q6_K", 2048, 768, 8, 1),
    }
    got = {(s.kernel, s.weight if s.kernel != "moe_mmvq" else "", s[-1])
           for s in tuner.widen(shapes, [1, 2, 3, 8])}  # fmt: skip
    assert got == {
        *(("mmvq", "Q4_K", m) for m in (1, 2)),
        *(("mmvq", "IQ4_NL", m) for m in (1, 2, 4, 8)),
        *(("mmvq_pair", "Q4_K", m) for m in (1, 2)),
        *(("moe_mmvq", "", t) for t in (1, 2, 4)),  # 8 x 8 assignments: the grouped path
    }


class FakeTimer:
    """Microseconds by launch shape: `times[(block_n, num_warps)]` (else 100); records calls."""

    def __init__(self, times: dict) -> None:
        self.times, self.calls = times, []

    def __call__(self, run, shape, config) -> float:
        self.calls.append(config)  # run() is not called: the interpreter is slow
        return self.times.get((config.block_n, config.num_warps), 100.0)


def test_tuner_picks_the_fastest_candidate_with_the_default_bits() -> None:
    shape = DenseShape("Q4_K", 12, 1024, 1)
    base = tuner.default_config(shape, DEV)
    # two other row counts than the default's (4 rows under the interpreter, 2 on an H200)
    rows_fast, rows_faster = [b for b in (8, 2, 16) if b != base.block_n][:2]
    fast, faster, wrong = (
        base._replace(block_n=rows_fast),
        base._replace(block_n=rows_faster),
        base._replace(groups=base.groups // 2),  # fewer groups a step: other sums, other bits
    )
    timer = FakeTimer({(base.block_n, base.num_warps): 10.0, (rows_fast, base.num_warps): 6.0,
                       (rows_faster, base.num_warps): 5.0})  # fmt: skip
    timer.times[(wrong.block_n, wrong.num_warps)] = 10.0
    result = tuner.tune_shape(shape, DEV, timer, lambda s, d: [fast, faster, wrong])
    assert result.best == faster and result.best_us == 5.0 and result.default_us == 10.0
    assert (result.tried, result.rejected) == (2, 1)
    assert wrong not in timer.calls  # rejected before timing
    # within MIN_GAIN of the default: the default stays
    timer = FakeTimer({(base.block_n, base.num_warps): 10.0, (rows_fast, base.num_warps): 9.9})
    assert tuner.tune_shape(shape, DEV, timer, lambda s, d: [fast]).best == base
    # the cache entries: the winner's knobs, read back by mmvq_config
    write(tuner.cache_entries([result]))
    assert mmvq_config(12, 1024, num_sms(DEV), 1, "once", False, T.Q4_K, DEV) == faster
    table = tuner.format_results([result])
    assert shape.key in table and f"block_n={rows_faster}" in table and "1 of 3" in table


def test_tuner_checks_a_pair_of_weights_and_padded_q6_k() -> None:
    shape = PairShape("Q4_K", "Q6_K/padded", 8, 4, 512, 2)
    base = tuner.default_config(shape, DEV)
    timer = FakeTimer({(base.block_n, base.num_warps): 10.0, (8, base.num_warps): 6.0})
    cands = [base._replace(block_n=8), base._replace(groups=1)]
    result = tuner.tune_shape(shape, DEV, timer, lambda s, d: cands)
    assert result.best == cands[0] and result.rejected == 1


def skip_if_the_interpreter_cannot_run_the_moe(error: Exception) -> None:
    """The MoE down kernel's `tl.range` over a program id fails in some Triton interpreter and
    numpy pairs (triton 3.6 with numpy 2.4: tests/kernels/test_moe_kernel.py fails likewise)."""
    if "0-dimensional arrays" in repr(error):
        pytest.skip("this Triton interpreter cannot run the MoE down kernel (numpy >= 2.4)")
    raise error


def test_tuner_checks_the_moe_gate_up_rows() -> None:
    from moestream.kernels.moe_mmvq import DEFAULT_CONFIG

    shape = MoeShape("Q4_K", "Q4_K", "Q6_K/padded", 256, 256, 1, 1)
    times = {(8, 1): 5.0, (32, 1): 1.0}

    def timer(run, shape, cfg) -> float:
        return times.get((cfg.up_block_n, cfg.up_warps), 10.0)

    cands = [
        tuning.with_knobs(DEFAULT_CONFIG, {"up_block_n": 8, "up_warps": 1}),
        # the "tile" gate/up kernel (plain `tl.sum`s, not `tree_sum`): other sums, other bits
        tuning.with_knobs(DEFAULT_CONFIG, {"up_block_n": 32, "up_warps": 1, "up_once": False}),
    ]
    try:
        result = tuner.tune_shape(shape, DEV, timer, lambda s, d: cands)
    except Exception as e:  # noqa: BLE001
        skip_if_the_interpreter_cannot_run_the_moe(e)
    assert result.best == cands[0] and result.best_us == 5.0 and result.rejected == 1
    write(tuner.cache_entries([result]))
    entry_ = json.loads(tuning.cache_path().read_text())["devices"][tuning.device_key(DEV)]
    assert entry_["moe_mmvq"][shape.key]["config"] == {"up_block_n": 8, "up_warps": 1}


@pytest.mark.skipif(DEVICE == "cuda", reason="forces the kernel path on CPU tensors")
def test_model_logits_are_the_same_bits_with_a_populated_cache(monkeypatch) -> None:
    """The tiny dense Qwen3 (Q8_0), its first layer's o_proj on the kernel path (the interpreter
    is slow): a 2-token prefill and a 1-token decode step (M = 2 and 1) give the same logits,
    bit for bit, with a cache that gives every launch other rows per program and warps."""
    from moestream.cli import DEMO_DRAFT
    from moestream.kernels import ops
    from moestream.layers import linear as linear_layer
    from moestream.layers.attention import AttentionMetadata
    from moestream.models.registry import build_model
    from moestream.weights.loader import open_model

    model = build_model(open_model(DEMO_DRAFT), "cpu", torch.bfloat16)
    model.layers = model.layers[:1]
    fast = {id(model.layers[0].attn.o_proj.weight)}
    monkeypatch.setattr(linear_layer, "device_path", lambda x: True)
    monkeypatch.setattr(ops, "_use_kernels", lambda x, *ws: all(id(w) in fast for w in ws))

    def run() -> list[torch.Tensor]:
        kv = model.make_kv_cache(1, 16)
        steps = [([11, 502], 0), ([77], 2)]  # (tokens, start)
        with torch.inference_mode():
            out = []
            for ids, start in steps:
                attn = AttentionMetadata.build([(start, len(ids), [0])], 16, "cpu")
                pos = torch.arange(start, start + len(ids))
                out.append(model.compute_logits(model.forward(torch.tensor(ids), pos, attn, kv)))
        return out

    with tuning.tracing() as seen:
        plain = run()
    assert {s.m_block for s in seen} == {1, 2} and all(isinstance(s, DenseShape) for s in seen)
    entries = {}
    for s in seen:
        base = tuner.default_config(s, DEV)
        knobs = {"block_n": 16 if base.block_n != 16 else 2, "num_warps": 4}
        entries[s.key] = entry(knobs, base)
    write({"mmvq": entries})
    for s in seen:  # the cache is in force
        assert tuning.tuned(DEV, s, tuner.default_config(s, DEV)).num_warps == 4
    cached = run()
    assert all(torch.equal(a, b) for a, b in zip(plain, cached, strict=True))


def test_compile_ahead_launches_every_config_the_tuner_will_run_in_workers() -> None:
    """`compile_ahead` covers the default and every candidate of each shape (in tasks of at
    most COMPILE_CHUNK), and runs them in spawned workers: under the interpreter each worker
    launches them on its own random operands; on a GPU it fills Triton's on-disk cache."""
    shape = DenseShape("Q4_K", 4, 256, 1)
    tasks = tuner.compile_tasks([shape], DEV)
    configs = [cfg for _, cfg_list in tasks for cfg in cfg_list]
    default = tuner.default_config(shape, DEV)
    assert configs == [default, *tuner.candidates(shape, default)]
    assert all(len(c) <= tuner.COMPILE_CHUNK for _, c in tasks)
    assert tuner.compile_ahead([shape], DEV, jobs=1, progress=False) == 0  # compile while timing
    assert tuner.compile_ahead([shape], DEV, jobs=2, progress=False) == len(configs)
