"""Fuzzed routing traces and placement files into `occult place` / `occult stats`: every case is
rc 0 or one `occult: error: --trace PATH: ...` line and rc 2; an existing --out stays unchanged."""

from __future__ import annotations

import json

import numpy as np
from _fuzz_cli import assert_clean, assert_flag_error, run_cli, unchanged
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from occult.placement import Placement
from occult.placement.synthetic import planted_trace

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FLAGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint64, np.float16, np.float32, np.bool_]
KEYS = [
    "layers.0.topk_ids",
    "layers.1.topk_ids",
    "layers.0.scores",
    "layers.1.scores",
    "layers.7.topk_ids",
    "layers.x.topk_ids",
    "layers.00.topk_ids",
    "other",
    "layers.99999999999999999999.topk_ids",
]
META_VALUES = st.one_of(
    st.sampled_from(["8", "2", "0", "-1", "3", "", "x", "1e3", "99999999999999999999", "16384", "16385"]),
    st.text(max_size=8),
)


def valid_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("fuzz") / "valid.safetensors"
    planted_trace(32, 8, 2, num_groups=2, num_layers=2, seed=0).trace.save(path)
    return path.read_bytes()


@st.composite
def tensors(draw):
    out = {}
    for key in draw(st.lists(st.sampled_from(KEYS), max_size=4, unique=True)):
        shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        values = draw(st.lists(st.integers(-3, 12), min_size=1, max_size=8))
        n = int(np.prod(shape))
        out[key] = np.resize(np.asarray(values), n).reshape(shape).astype(dtype)
    return out


@st.composite
def metadata(draw):
    keys = draw(st.lists(st.sampled_from(["num_experts", "top_k", "num_layers", "format", "misc"]), unique=True))
    return {k: draw(META_VALUES) for k in keys}


def _place_and_stats(path, out):
    before = out.read_bytes()
    res = run_cli("place", "--trace", path, "-d", 2, "--method", "greedy", "--out", out, "--json")
    assert_clean(res)
    if res.code != 0:
        assert res.err.startswith("occult: error: --"), res.err  # a flag first
        unchanged(out, before)
        out.write_bytes(before)
    res = run_cli("stats", "--trace", path, "-d", 2, "--json")
    assert_clean(res)
    return res


@FUZZ
@given(tensors=tensors(), meta=metadata())
def test_structured_traces(tmp_path_factory, tensors, meta):
    d = tmp_path_factory.mktemp("t")
    path, out = d / "t.safetensors", d / "p.json"
    out.write_text("keep me\n")
    save_file(tensors, str(path), metadata=meta)
    _place_and_stats(path, out)


@FUZZ
@given(data=st.data())
def test_damaged_trace_bytes(tmp_path_factory, data):
    d = tmp_path_factory.mktemp("b")
    good = (
        valid_bytes(tmp_path_factory)
        if not hasattr(test_damaged_trace_bytes, "good")
        else test_damaged_trace_bytes.good
    )
    test_damaged_trace_bytes.good = good
    how = data.draw(st.sampled_from(["truncate", "flip", "random"]))
    if how == "truncate":
        blob = good[: data.draw(st.integers(0, len(good) - 1))]
    elif how == "flip":
        blob = bytearray(good)
        for i in data.draw(st.lists(st.integers(0, len(good) - 1), min_size=1, max_size=4)):
            blob[i] = data.draw(st.integers(0, 255))
        blob = bytes(blob)
    else:
        blob = data.draw(st.binary(max_size=200))
    path, out = d / "t.safetensors", d / "p.json"
    path.write_bytes(blob)
    out.write_text("keep me\n")
    res = _place_and_stats(path, out)
    if res.code and str(path) in res.err:
        assert res.err.startswith(f"occult: error: --trace {path}"), res.err


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 10)
    | st.floats()
    | st.text(max_size=4)
    | st.sampled_from([2**70, -(2**70)]),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)


@st.composite
def placement_docs(draw):
    doc = {"num_devices": 2, "num_experts": 8, "layers": [[0, 0, 0, 0, 1, 1, 1, 1]] * 2}
    for key in draw(
        st.lists(st.sampled_from(["num_devices", "num_experts", "layers", "num_nodes", "extra"]), unique=True)
    ):
        if draw(st.booleans()):
            doc.pop(key, None)
        else:
            doc[key] = draw(JSON)
    return doc


@FUZZ
@given(doc=placement_docs(), text=st.one_of(st.none(), st.text(max_size=40), st.just("[" * 5000)))
def test_placement_files(tmp_path_factory, doc, text):
    d = tmp_path_factory.mktemp("p")
    trace = d / "t.safetensors"
    planted_trace(32, 8, 2, num_groups=2, num_layers=2, seed=0).trace.save(trace)
    path = d / "p.json"
    path.write_text(json.dumps(doc) if text is None else text)
    res = run_cli("stats", "--trace", trace, "--placement", path, "--json")
    assert_clean(res, "--placement", path)


NUMBERS = st.one_of(
    st.integers(-5, 40),
    st.sampled_from([2**31, 2**63, 10**30]),
    st.text(max_size=6),
    st.sampled_from(["1e3", "nan", "inf", "-inf", "0x10", "", " 4", "1.5"]),
)


@FLAGS
@given(
    flag=st.sampled_from(
        ["--devices", "--nodes", "--seed", "--jobs", "--kahypar-tokens", "--hidden", "--max-load", "--plot-layers"]
    ),
    value=NUMBERS,
)
def test_place_numeric_flags(tmp_path_factory, flag, value):
    d = tmp_path_factory.mktemp("n")
    trace, out = d / "t.safetensors", d / "p.json"
    planted_trace(32, 8, 2, num_groups=2, num_layers=2, seed=0).trace.save(trace)
    out.write_text("keep me\n")
    args = ["place", "--trace", trace, "--method", "greedy", "--out", out, "--json"]
    args += [flag, value] + ([] if flag == "--devices" else ["-d", 2])
    if flag == "--plot-layers":
        args += ["--plot", d / "x.png"]
    res = run_cli(*args)
    assert_flag_error(res)
    if res.code:
        unchanged(out, b"keep me\n")


def test_known_examples(tmp_path):
    """Examples the fuzzing found once, kept as plain tests."""
    trace = tmp_path / "t.safetensors"
    ids = np.array([[0, 1], [2, 3]], np.int16)
    save_file(
        {"layers.0.topk_ids": ids, "layers.99999999999999999999.topk_ids": ids},
        str(trace),
        metadata={"num_experts": "4", "top_k": "2"},
    )  # once: a list of 10^20 missing layers (memory)
    assert_clean(run_cli("place", "--trace", trace, "-d", 2), "--trace", trace)
    save_file({"layers.0.topk_ids": ids}, str(trace), metadata={"num_experts": "99999999999999999999", "top_k": "2"})
    res = run_cli("stats", "--trace", trace, "-d", 2)  # once: an E x E matrix of any size
    assert_clean(res, "--trace", trace)
    assert res.code == 2
    good = tmp_path / "g.safetensors"
    save_file({"layers.0.topk_ids": ids}, str(good), metadata={"num_experts": "4", "top_k": "2"})
    res = run_cli("place", "--trace", good, "-d", 2, "--seed", 2**31)  # once: a TypeError in Mt-KaHyPar
    assert_flag_error(res)
    assert res.code == 2
    p = tmp_path / "p.json"
    for text in (
        '{"num_devices": [], "num_experts": 4, "layers": [[0,0,1,1]]}',  # once: TypeError
        '{"num_devices": 2, "num_experts": 4, "layers": [[0,0,1,99999999999999999999]]}',  # OverflowError
        "[" * 100000,  # RecursionError
        '{"num_devices": 1e400, "num_experts": 4, "layers": [[0,0,1,1]]}',  # OverflowError
        '{"num_devices": 2.5, "num_experts": 4, "layers": [[0,0,1,1]]}',
    ):  # silently 2 devices
        p.write_text(text)
        res = run_cli("stats", "--trace", good, "--placement", p)
        assert res.code == 2
        assert_clean(res, "--placement", p)
    Placement.contiguous(4, 2, 3).save(p)
    assert_clean(run_cli("stats", "--trace", good, "--placement", p), "--placement", p)
    out = tmp_path / "out.json"  # once: --out written before --plot-layers failed
    out.write_text("keep me\n")
    res = run_cli("place", "--trace", good, "-d", 2, "--out", out, "--plot", tmp_path / "x.png", "--plot-layers", 2)
    assert res.code == 2 and "--plot-layers" in res.err
    unchanged(out, b"keep me\n")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage")
    res = run_cli("place", "--trace", bad, "-d", 2)
    assert res.err.startswith(f"occult: error: --trace {bad}: not a readable safetensors file"), res.err
