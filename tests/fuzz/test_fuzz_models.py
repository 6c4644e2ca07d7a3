"""Fuzzed occult checkpoints, transformers config.json files and calibration data into `occult
profile` / `occult finetune`: rc 0 or one `occult: error: FLAG PATH: ...` line and rc 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _fuzz_cli import assert_clean, run_cli, unchanged
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from occult.lm.checkpoint import save_model
from occult.lm.model import ModelConfig, OccultLM

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
REPO = Path(__file__).resolve().parents[2]
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 70),
    st.sampled_from([2**40, 10**30, 1.5, float("nan")]),
    st.text(max_size=5),
    st.lists(st.integers(0, 3), max_size=2),
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny OccultLM weights file: (tensors, metadata)."""
    path = tmp_path_factory.mktemp("ckpt") / "m.safetensors"
    torch.manual_seed(0)
    save_model(
        path,
        OccultLM(
            ModelConfig(
                vocab_size=64,
                hidden_size=16,
                num_layers=2,
                num_heads=2,
                num_experts=4,
                top_k=2,
                expert_ffn_size=8,
                max_seq_len=16,
            )
        ),
    )
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata()), path.read_bytes()


@st.composite
def metadata_edits(draw):
    cfg = dict.fromkeys(
        [
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_experts",
            "top_k",
            "expert_ffn_size",
            "max_seq_len",
            "rope_theta",
            "rms_eps",
            "tie_embeddings",
            "norm_topk_prob",
            "init_std",
            "extra",
        ]
    )
    edits = draw(st.dictionaries(st.sampled_from(sorted(cfg)), VALUES, max_size=3))
    routing = draw(
        st.one_of(
            st.none(),
            st.just("{not json"),
            st.builds(
                json.dumps,
                st.dictionaries(
                    st.sampled_from(["max_devices", "method", "placement", "similarity"]), VALUES, max_size=3
                ),
            ),
        )
    )
    drop = draw(
        st.lists(
            st.sampled_from(["model.embed.weight", "model.blocks.1.attn.qkv.weight", "model_config", "format"]),
            max_size=1,
        )
    )
    return edits, routing, drop


@FUZZ
@given(edit=metadata_edits())
def test_checkpoint_metadata(ckpt, tmp_path_factory, edit):
    tensors, meta, _ = ckpt
    edits, routing, drop = edit
    cfg = {**json.loads(meta["model_config"]), **edits}
    meta = {**meta, "model_config": json.dumps(cfg)}
    if routing is not None:
        meta["routing"] = routing
    meta = {k: v for k, v in meta.items() if k not in drop}
    d = tmp_path_factory.mktemp("m")
    path, out = d / "m.safetensors", d / "t.safetensors"
    save_file({k: v for k, v in tensors.items() if k not in drop}, str(path), metadata=meta)
    out.write_bytes(b"keep")
    res = run_cli("profile", "--model", path, "--out", out, "--corpus-dir", d / "none", "--tokens", 8)
    assert_clean(res)
    assert res.code == 2  # --corpus-dir does not exist: nothing is profiled
    unchanged(out, b"keep")
    if str(path) in res.err:
        assert res.err.startswith(f"occult: error: --model {path}"), res.err


@FUZZ
@given(data=st.data())
def test_checkpoint_bytes(ckpt, tmp_path_factory, data):
    good = ckpt[2]
    blob = bytearray(good[: data.draw(st.integers(0, len(good)))])
    for i in data.draw(st.lists(st.integers(0, max(len(blob) - 1, 0)), max_size=3)) if blob else []:
        blob[i] = data.draw(st.integers(0, 255))
    d = tmp_path_factory.mktemp("b")
    path = d / "m.safetensors"
    path.write_bytes(bytes(blob))
    res = run_cli("finetune", "--init", path, "--out", d / "run", "--corpus-dir", d / "none", "--steps", 1)
    assert_clean(res)
    assert res.code == 2


def test_checkpoint_examples(ckpt, tmp_path):
    """Examples the fuzzing found once, kept as plain tests."""
    tensors, meta, _ = ckpt
    path = tmp_path / "m.safetensors"
    prep = tmp_path / "prep"
    prep.mkdir()
    for edits in ({"num_experts": 10**9}, {"max_seq_len": 10**12}, {"rope_theta": "x"}):  # allocations / TypeError
        save_file(
            tensors,
            str(path),
            metadata={**meta, "model_config": json.dumps({**json.loads(meta["model_config"]), **edits})},
        )
        res = run_cli("profile", "--model", path, "--out", tmp_path / "t.safetensors", "--corpus-dir", prep)
        assert res.code == 2 and res.err.startswith(f"occult: error: --model {path}: "), res.err
    save_file(tensors, str(path), metadata={**meta, "routing": "[1]"})  # once: AttributeError on a list
    res = run_cli("profile", "--model", path, "--out", tmp_path / "t.safetensors", "--corpus-dir", tmp_path / "none")
    assert_clean(res)


HF_EDITS = st.dictionaries(
    st.sampled_from(
        [
            "model_type",
            "num_experts",
            "num_experts_per_tok",
            "hidden_size",
            "num_hidden_layers",
            "vocab_size",
            "intermediate_size",
            "architectures",
        ]
    ),
    VALUES.filter(lambda v: not isinstance(v, int) or isinstance(v, bool) or v < 64),
    max_size=2,
)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny transformers model directory (config.json and weights) and its config."""
    from occult.integrations.hf.tiny import tiny_random_model

    path = tmp_path_factory.mktemp("hfmodel")
    tiny_random_model("olmoe", str(path))
    return path, json.loads((path / "config.json").read_text())


def _copy(model: Path, d: Path) -> None:
    for f in model.iterdir():
        (d / f.name).write_bytes(f.read_bytes())


@SLOW
@given(edits=HF_EDITS, text=st.one_of(st.none(), st.sampled_from(["", "[]", '"model_type"', "{", "[" * 5000])))
def test_transformers_config(hf_model, tmp_path_factory, edits, text):
    d = tmp_path_factory.mktemp("hf")
    _copy(hf_model[0], d)
    hf_config = hf_model[1]
    (d / "config.json").write_text(json.dumps({**hf_config, **edits}) if text is None else text)
    out = d / "t.safetensors"
    out.write_bytes(b"keep")
    res = run_cli("profile", "--model", d, "--data", "random", "--out", out, "--tokens", 8, "--seq-len", 4)
    assert_clean(res, "--model", d)
    if res.code:
        unchanged(out, b"keep")
    res = run_cli(
        "finetune",
        "--hf",
        d,
        "--out",
        d / "run",
        "--data",
        "random",
        "--steps",
        1,
        "--stop-after",
        1,
        "--batch-size",
        1,
        "--seq-len",
        4,
        "--save-every",
        0,
        "--no-progress",
    )
    assert_clean(res)
    if res.code and str(d) in res.err:
        assert res.err.startswith(f"occult: error: --hf {d}") or "--out" in res.err, res.err


@SLOW
@given(
    kind=st.sampled_from([".txt", ".jsonl", ".npy", ".safetensors", ".pt"]),
    blob=st.binary(max_size=64),
    lines=st.lists(st.text(max_size=12), max_size=4),
)
def test_calibration_data(hf_model, tmp_path_factory, kind, blob, lines):
    d = tmp_path_factory.mktemp("cal")
    _copy(hf_model[0], d)
    data = d / f"data{kind}"
    if kind in (".txt", ".jsonl") and lines:
        data.write_text("\n".join(lines))
    else:
        data.write_bytes(blob)
    res = run_cli(
        "finetune",
        "--hf",
        d,
        "--out",
        d / "run",
        "--data",
        data,
        "--steps",
        1,
        "--stop-after",
        1,
        "--batch-size",
        1,
        "--seq-len",
        4,
        "--save-every",
        0,
        "--no-progress",
    )
    assert_clean(res)


def test_calibration_examples(hf_model, tmp_path):
    """Found once: torch.load's several-line message for a .pt that is not a tensor file."""
    _copy(hf_model[0], tmp_path)
    data = tmp_path / "data.pt"
    data.write_bytes(b"\x80\x02}q\x00.")
    res = run_cli("finetune", "--hf", tmp_path, "--out", tmp_path / "run", "--data", data, "--steps", 1)
    assert res.code == 2 and res.err.startswith(f"occult: error: --data {data} ") and res.err.count("\n") == 1, res.err


def test_real_entry_point(tmp_path):
    """`python -m occult` itself: one error line, rc 2, no traceback (corrupt trace, placement, checkpoint)."""
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 9)
    placement = tmp_path / "p.json"
    placement.write_text('{"num_devices": [], "num_experts": 4, "layers": [[0]]}')
    trace = REPO / "occult/data/example_trace.safetensors"
    for argv, flag, path in (
        (["place", "--trace", bad, "-d", "2"], "--trace", bad),
        (["stats", "--trace", trace, "--placement", placement], "--placement", placement),
        (["profile", "--model", bad, "--out", tmp_path / "t.safetensors"], "--model", bad),
    ):
        p = subprocess.run(
            [sys.executable, "-m", "occult", *map(str, argv)], capture_output=True, text=True, cwd=REPO, timeout=120
        )
        assert p.returncode == 2, p.stderr
        assert p.stderr.count("\n") == 1 and p.stderr.startswith(f"occult: error: {flag} {path}: "), p.stderr
