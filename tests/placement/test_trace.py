"""Routing traces: file round trips, validation errors, the recorder, the synthetic generators."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from safetensors.torch import save_file as save_torch

from occult.placement.synthetic import expert_popularity, planted_trace, uniform_trace
from occult.placement.trace import (
    Trace,
    TraceError,
    TraceRecorder,
    example_trace_path,
    load_example_trace,
    metadata_json,
    read_trace,
    trace_info,
    write_trace,
)


def _ids(rng: np.random.Generator, T: int, E: int, K: int) -> np.ndarray:
    return np.ascontiguousarray(np.argsort(rng.random((T, E)), axis=1)[:, :K])


def _meta(E: int = 16, K: int = 4) -> dict[str, str]:
    return {"num_experts": str(E), "top_k": str(K)}


# ------------------------------------------------------------------ round trips
def test_write_read_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    ids = [_ids(rng, 300, 16, 4), _ids(rng, 200, 16, 4)]
    scores = [rng.random((300, 16)).astype(np.float32), None]
    trace = Trace(ids, 16, 4, scores, {"model": "tiny", "num_experts": "ignored"})
    path = tmp_path / "t.safetensors"
    write_trace(path, trace)
    back = read_trace(path)
    assert back.num_layers == 2 and back.num_experts == 16 and back.top_k == 4
    assert back.num_tokens == [300, 200]
    for a, b in zip(ids, back.topk_ids):
        assert b.dtype == np.int16  # compact on disk
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(back.scores[0], scores[0])
    assert back.scores[1] is None
    assert back.metadata["model"] == "tiny"
    only = read_trace(path, layers=[1])
    assert only.num_layers == 1
    np.testing.assert_array_equal(only.layer(0), ids[1])
    info = trace_info(path)
    assert info["num_layers"] == 2 and info["tokens"] == [300, 200] and info["num_experts"] == "16"


def test_reads_foreign_files_int64_and_bf16_scores(tmp_path):
    """A trace written by another tool (torch, int64 ids, bf16 top-k scores, no num_layers)."""
    rng = np.random.default_rng(2)
    ids = torch.from_numpy(_ids(rng, 50, 16, 4).astype(np.int64))
    scores = torch.rand(50, 4, dtype=torch.bfloat16)
    path = tmp_path / "foreign.safetensors"
    save_torch({"layers.0.topk_ids": ids, "layers.0.scores": scores}, str(path), metadata={"num_experts": "16"})
    t = read_trace(path)
    assert t.top_k == 4  # inferred from the shape when the metadata has none
    np.testing.assert_array_equal(t.layer(0), ids.numpy())
    assert t.scores[0].dtype == np.float32
    np.testing.assert_array_equal(t.scores[0], scores.float().numpy())


def test_large_expert_count_uses_int32(tmp_path):
    rng = np.random.default_rng(3)
    trace = Trace([_ids(rng, 20, 40000, 2)], 40000, 2)
    write_trace(tmp_path / "big.safetensors", trace)
    assert read_trace(tmp_path / "big.safetensors").layer(0).dtype == np.int32


def test_recorder(tmp_path):
    rng = np.random.default_rng(4)
    rec = TraceRecorder(num_experts=16, top_k=4, metadata={"source": "test"})
    batches = {0: [_ids(rng, 10, 16, 4), _ids(rng, 7, 16, 4)], 1: [_ids(rng, 17, 16, 4)]}
    rec.add(1, torch.from_numpy(batches[1][0]))
    for b in batches[0]:
        rec.add(0, b.reshape(1, -1, 4))  # [batch, seq, k] is flattened
    rec.save(tmp_path / "rec.safetensors")
    t = read_trace(tmp_path / "rec.safetensors")
    np.testing.assert_array_equal(t.layer(0), np.concatenate(batches[0]))
    np.testing.assert_array_equal(t.layer(1), batches[1][0])
    assert t.metadata["source"] == "test"
    gap = TraceRecorder(16, 4)
    gap.add(1, batches[1][0])
    with pytest.raises(TraceError, match=r"layer\(s\) \[0\]"):
        gap.to_trace()


def test_example_trace_is_small_and_planted():
    path = example_trace_path()
    assert path.stat().st_size < 2_000_000
    t = load_example_trace()
    assert (t.num_layers, t.num_experts, t.top_k) == (4, 64, 8)
    assert min(t.num_tokens) >= 16000
    groups = np.asarray(metadata_json(t, "planted_groups"))
    assert groups.shape == (4, 64)
    assert all(np.array_equal(np.bincount(g), [16] * 4) for g in groups)


# ------------------------------------------------------------------ bad files
def test_missing_file_and_directory(tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        read_trace(tmp_path / "nope.safetensors")
    with pytest.raises(TraceError, match="is a directory"):
        read_trace(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupted_file(tmp_path, damage):
    path = tmp_path / "t.safetensors"
    write_trace(path, uniform_trace(100, 16, 4, seed=0))
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x07" * 64 + data[64:])
    else:
        path.write_bytes(b"")
    with pytest.raises(TraceError, match="not a readable safetensors file.*corrupted"):
        read_trace(path)


def test_missing_layer(tmp_path):
    rng = np.random.default_rng(5)
    path = tmp_path / "gap.safetensors"
    tensors = {f"layers.{i}.topk_ids": _ids(rng, 10, 16, 4).astype(np.int16) for i in (0, 1, 3)}
    save_file(tensors, str(path), metadata=_meta())
    with pytest.raises(TraceError, match=r"layer\(s\) \[2\] missing"):
        read_trace(path)
    # scores without ids also count as a missing layer
    save_file(
        {"layers.0.topk_ids": tensors["layers.0.topk_ids"], "layers.1.scores": rng.random((10, 16))},
        str(path),
        metadata=_meta(),
    )
    with pytest.raises(TraceError, match=r"\[1\] missing"):
        read_trace(path)


def test_layer_numbers_with_leading_zeros_are_not_layers(tmp_path):
    """'layers.00.topk_ids' is not layer 0 (found by the trace fuzzer: it was read as layer 0, then
    'layers.0.topk_ids' looked up, a raw SafetensorError); a 0-d ids tensor is refused by trace_info."""
    path = tmp_path / "zeros.safetensors"
    save_file(
        {"layers.1.topk_ids": np.array(0, dtype=np.int8), "layers.00.topk_ids": np.array(0, dtype=np.int8)},
        str(path),
        metadata=_meta(),
    )
    with pytest.raises(TraceError, match=r"layer\(s\) \[0\] missing"):
        read_trace(path)
    save_file({"layers.0.topk_ids": np.array(0, dtype=np.int8)}, str(path), metadata=_meta())
    with pytest.raises(TraceError, match=r"shape \[\], expected \[tokens, top_k\]"):
        trace_info(path)


def test_num_layers_metadata_mismatch(tmp_path):
    rng = np.random.default_rng(6)
    path = tmp_path / "short.safetensors"
    save_file({"layers.0.topk_ids": _ids(rng, 10, 16, 4)}, str(path), metadata={**_meta(), "num_layers": "3"})
    with pytest.raises(TraceError, match="num_layers=3.*1 layer"):
        read_trace(path)


def test_missing_or_bad_metadata(tmp_path):
    rng = np.random.default_rng(7)
    path = tmp_path / "m.safetensors"
    save_file({"layers.0.topk_ids": _ids(rng, 10, 16, 4)}, str(path))
    with pytest.raises(TraceError, match="no 'num_experts'.*metadata"):
        read_trace(path)
    save_file({"layers.0.topk_ids": _ids(rng, 10, 16, 4)}, str(path), metadata={"num_experts": "sixteen"})
    with pytest.raises(TraceError, match="'num_experts' is 'sixteen', expected an integer"):
        read_trace(path)
    save_file({"something": _ids(rng, 10, 16, 4)}, str(path), metadata=_meta())
    with pytest.raises(TraceError, match="no tensors named 'layers.<i>.topk_ids'"):
        read_trace(path)


def test_ids_out_of_range(tmp_path):
    rng = np.random.default_rng(8)
    ids = _ids(rng, 10, 16, 4)
    ids[6, 2] = 16
    path = tmp_path / "r.safetensors"
    save_file({"layers.0.topk_ids": ids}, str(path), metadata=_meta())
    with pytest.raises(TraceError, match=r"expert id 16 is out of range \[0, 16\).*token 6.*num_experts"):
        read_trace(path)
    ids[6, 2] = -1
    with pytest.raises(TraceError, match=r"expert id -1 is out of range"):
        Trace([ids], 16, 4)


@pytest.mark.parametrize(
    "ids, meta, match",
    [
        (np.zeros(10, dtype=np.int32), _meta(), r"shape \[tokens, top_k\], got shape \[10\]"),
        (np.zeros((10, 3), dtype=np.int32), _meta(), "has 3 ids per token, but top_k is 4"),
        (np.zeros((0, 4), dtype=np.int32), _meta(), "holds no tokens"),
        (np.tile(np.arange(4, dtype=np.float32), (5, 1)), _meta(), "dtype float32, expected an integer"),
        (np.array([[1, 2, 3, 1]] * 3, dtype=np.int32), _meta(), "token 0 picks an expert more than once"),
        (np.zeros((3, 20), dtype=np.int32), _meta(16, 20), r"top_k must be in \[1, num_experts=16\]"),
    ],
)
def test_wrong_shapes_and_dtypes(tmp_path, ids, meta, match):
    path = tmp_path / "bad.safetensors"
    save_file({"layers.0.topk_ids": ids}, str(path), metadata=meta)
    with pytest.raises(TraceError, match=match):
        read_trace(path)


def test_wrong_scores(tmp_path):
    rng = np.random.default_rng(9)
    ids = _ids(rng, 10, 16, 4)
    with pytest.raises(TraceError, match=r"shape \[10, 5\], expected \[10, 16\].*or \[10, 4\]"):
        Trace([ids], 16, 4, [rng.random((10, 5))])
    with pytest.raises(TraceError, match="expected a float dtype"):
        Trace([ids], 16, 4, [np.zeros((10, 16), dtype=np.int32)])


def test_error_names_the_file(tmp_path):
    path = tmp_path / "named.safetensors"
    save_file({"layers.0.topk_ids": np.zeros((3, 3), dtype=np.int32)}, str(path), metadata=_meta(16, 3))
    with pytest.raises(TraceError, match=f"{path}: layer 0.*more than once"):
        read_trace(path)


# ------------------------------------------------------------------ synthetic
def test_uniform_trace_is_valid_and_uniform():
    t = uniform_trace(40000, 32, 4, num_layers=2, seed=10)
    assert t.num_layers == 2 and t.layer(0).shape == (40000, 4)
    srt = np.sort(t.layer(1), axis=1)
    assert (srt[:, 1:] != srt[:, :-1]).all()
    load = np.bincount(t.layer(0).ravel(), minlength=32) / (40000 * 4)
    assert np.abs(load - 1 / 32).max() < 0.004
    assert not np.array_equal(t.layer(0), t.layer(1))
    np.testing.assert_array_equal(
        uniform_trace(100, 32, 4, seed=3).layer(0), uniform_trace(100, 32, 4, seed=3).layer(0)
    )


def test_skewed_popularity():
    rng = np.random.default_rng(0)
    p = expert_popularity(64, 1.0, rng)
    assert np.isclose(p.sum(), 1) and np.isclose(p.max() / p.min(), 64)
    t = uniform_trace(20000, 64, 1, skew=1.0, seed=11)  # k = 1: loads follow p exactly
    load = np.bincount(t.layer(0).ravel(), minlength=64)
    hot = np.argsort(load)[-5:]
    assert load[hot].sum() > 20000 * 0.3  # Zipf(1) over 64 experts: top 5 carry ~49%


@pytest.mark.parametrize("noise, skew", [(0.0, 0.0), (0.2, 0.0), (0.1, 1.0)])
def test_planted_trace_follows_its_groups(noise, skew):
    pt = planted_trace(30000, 64, 8, num_groups=4, noise=noise, skew=skew, seed=12)
    ids = pt.trace.layer(0)
    g = pt.groups_LE[0]
    assert np.array_equal(np.bincount(g), [16] * 4)
    assert not np.array_equal(g, np.arange(64) // 16)  # groups are scattered over expert ids
    groups_TK = g[ids]
    majority = np.array([np.bincount(row, minlength=4).max() for row in groups_TK[:2000]])
    # fraction of picks outside the token's (majority) group ~ noise * (outside share)
    outside = 1 - majority.mean() / 8
    assert abs(outside - noise) < 0.03
    srt = np.sort(ids, axis=1)
    assert (srt[:, 1:] != srt[:, :-1]).all()
    p = pt.placement(4)
    assert p.num_devices == 4 and np.array_equal(p.expert_device(0), g)
    assert pt.placement(2).experts_per_device == 32


def test_planted_trace_argument_errors():
    with pytest.raises(ValueError, match="num_groups must divide"):
        planted_trace(10, 64, 8, num_groups=5)
    with pytest.raises(ValueError, match="cannot hold a token's 8 picks"):
        planted_trace(10, 64, 8, num_groups=16)
    with pytest.raises(ValueError, match="noise"):
        planted_trace(10, 64, 8, num_groups=4, noise=1.5)
    with pytest.raises(ValueError, match="top_k"):
        uniform_trace(10, 4, 5)
    pt = planted_trace(100, 64, 8, num_groups=4, seed=0)
    with pytest.raises(ValueError, match="cannot be spread evenly over 8 devices"):
        pt.placement(8)
