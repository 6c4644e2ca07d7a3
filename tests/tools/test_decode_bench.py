"""CPU smoke tests of the decode-step benchmark `benchmarks/decode.py` and its serving mode
`benchmarks/serve.py` (prefill + decode with a static KV cache) (2 gloo ranks, tiny model)."""

from __future__ import annotations

import functools
import json

import pytest
from _bench_helpers import ROOT, torchrun  # tests/tools/_bench_helpers.py

pytest.importorskip("transformers")

SCRIPT = ROOT / "benchmarks" / "decode.py"
EAGER = ("replicated", "standard", "dedup", "standard-syncfree", "dedup-syncfree")
GRAPH = ("replicated+graph", "standard-syncfree+graph", "dedup-syncfree+graph")
BATCHES = ("1", "4")
_torchrun = functools.partial(torchrun, SCRIPT)


def test_decode_tiny_every_variant(tmp_path):
    out = tmp_path / "decode.json"
    res = _torchrun(2, "--model", "tiny", "--batch", "1,4", "--iters", "3", "--warmup", "1", "--out", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["env"]["world_size"] == 2 and "NCCL_P2P_DISABLE" in report["env"]
    assert report["env"]["torch"] and report["env"]["transformers"]
    assert report["config"]["batch"] == [1, 4] and report["config"]["iters"] == 3
    assert set(report["variants"]) == set(EAGER + GRAPH)
    for name in EAGER:
        v = report["variants"][name]
        assert v["graph"] is False and v["sync_free"] == name.endswith("syncfree")
        for b in BATCHES:
            r = v["batches"][b]
            # fp32 on CPU: the converted model is the unconverted one up to rounding
            assert r["check"]["passed"] and r["check"]["median_rel_err"] < 1e-4, (name, b, r["check"])
            assert r["check"]["argmax_agreement"] == 1.0
            assert 0 < r["ms_p10"] <= r["ms_p50"] <= r["ms_p90"] <= r["ms_p99"], (name, b, r)
            assert len(r["ms_all"]) == 3 and r["tokens_per_s_per_gpu"] > 0
            assert r["comm"]["forward_rows"] > 0
    for name in GRAPH:
        for b in BATCHES:
            assert "CUDA graphs need a GPU" in report["variants"][name]["batches"][b]["skipped"]
    rows = {(r["batch"], r["variant"]): r for r in report["table"]}
    assert rows[(4, "replicated")]["x_floor"] == pytest.approx(1.0)  # no graphs on CPU: the eager floor
    assert rows[(1, "dedup")]["floor"] == "replicated" and rows[(1, "dedup")]["x_floor"] > 0
    assert report["variants"]["replicated"]["batches"]["4"]["comm"]["forward_remote_rows"] == 0
    lines = res.stdout.strip().splitlines()
    assert lines[-1].startswith("| 4 | dedup-syncfree+graph | CUDA graphs need a GPU")
    assert "| batch | variant | ms p50 | ms p99 | tok/s/GPU | x floor |" in lines


@pytest.mark.parametrize(
    "args, message",
    [
        (["--variants", "dedup,bogus"], "unknown variant"),
        (["--batch", "8,0"], "every batch size must be >= 1"),
        (["--batch", "x"], "batch sizes must be integers"),
    ],
)
def test_decode_bad_arguments_fail_clearly(args, message, capsys, monkeypatch):
    """Refused by decode.py's argument parsing (in this process: no interpreter start per case)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import decode

    with pytest.raises(SystemExit) as exit_info:
        decode.main(args)
    stderr = capsys.readouterr().err
    assert exit_info.value.code != 0
    assert message in stderr, stderr[-2000:]


def test_decode_experts_not_divisible_by_world_size_fails_clearly(monkeypatch):
    """decode.py's model config meets e2e.py's setup check (`start_run` refuses it before any work: exit 2 on
    every rank, no output file, shown end to end on 3 torchrun ranks by test_e2e_bench.py)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import decode
    from e2e import check_setup

    args = decode.parse_args(["--model", "tiny", "--batch", "1"])
    assert "not divisible by world size 3" in check_setup(args, decode.model_config(args), 3)
    assert check_setup(args, decode.model_config(args), 2) is None


# ------------------------------------------------------------ serving mode: benchmarks/serve.py
SERVE = ROOT / "benchmarks" / "serve.py"
SERVE_EAGER = ("replicated", "standard", "dedup", "dedup-syncfree")
SERVE_GRAPH = ("replicated+graph", "standard-syncfree+graph", "dedup-syncfree+graph", "generate+graph")
SERVE_GENERATE = ("native-generate", "generate")  # whole generate calls timed from outside
_torchrun_serve = functools.partial(torchrun, SERVE)


def test_serve_tiny_every_variant(tmp_path):
    out = tmp_path / "serve.json"
    res = _torchrun_serve(
        2,
        "--model",
        "tiny",
        "--batch",
        "1,4",
        "--prompt-len",
        "8",
        "--new-tokens",
        "4",
        "--repeats",
        "2",
        "--out",
        str(out),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["env"]["world_size"] == 2 and report["config"]["new_tokens"] == 4
    assert set(report["variants"]) == set(
        SERVE_EAGER + SERVE_GRAPH + SERVE_GENERATE + ("native", "native-generate+compile")
    )
    for name in SERVE_EAGER + ("native",):
        for b in BATCHES:
            r = report["variants"][name][b]
            # fp32 on CPU: prefill + 3 forced decode steps equal the unconverted model up to rounding
            assert r["check"]["passed"] and r["check"]["median_rel_err"] < 1e-4, (name, b, r["check"])
            assert r["check"]["argmax_agreement"] == 1.0
            assert len(r["ms_all"]) == 2 * 4 and len(r["prefill_ms_all"]) == 2
            assert 0 < r["ms_p10"] <= r["ms_p50"] <= r["ms_p90"] <= r["ms_p99"], (name, b, r)
            assert r["decode_tokens_per_s_per_gpu"] > r["e2e_tokens_per_s_per_gpu"] > 0
            assert r["hbm_fraction"] == pytest.approx(
                r["step_bytes"]["total"] / (r["ms_p50"] / 1e3) / 1e9 / report["peaks"]["copy_gb_s"]
            )
    for name in SERVE_GENERATE:  # native: transformers' generate on the unconverted model; generate: hf.generate
        for b in BATCHES:
            r = report["variants"][name][b]
            assert r["check"]["passed"] and r["ms_p50"] > 0, (name, b, r)
            # one more call marked at each token (transformers: its 4 tokens' logits processor calls, 3 steps apart;
            # occult: after each of its decoder's 3 steps, 2 apart), the slowest rank's: the reported step p50
            assert len(r["step_ms_all"]) == (3 if name == "native-generate" else 2), (name, b, r)
            assert r["ms_p50"] == r["step_events_ms_p50"] and 0 < r["ms_p50"] <= r["ms_p90"] <= r["ms_p99"], r
            assert r["decode_tokens_per_s_per_gpu"] == pytest.approx(
                int(b) / (sum(r["step_ms_all"]) / len(r["step_ms_all"]) / 1e3)
            )
            assert r["per_step_over_whole_call"] == pytest.approx(r["ms_p50"] / r["step_ms_mean"])
            assert len(r["generate_ms_all"]) == len(r["shorter_ms_all"]) == 2 and r["compile_s"] >= 0
            assert r["shorter_calls_tokens"] == 2
            assert r["generate_ms_p50"] == pytest.approx(r["prefill_estimate_ms"] + 3 * r["step_ms_mean"])
            # prefill is that estimate when positive, else none (noise: never a negative time)
            assert r["prefill_ms_p50"] == (r["prefill_estimate_ms"] if r["prefill_estimate_ms"] > 0 else None)
    for b in BATCHES:
        # the reference model itself: equal up to float32 rounding (its batched and per-prompt runs take other
        # matmul blockings, in an order that depends on the CPU's vector kernels): a few eps per op over the
        # model's ops, a bound of 64 eps; a wrong batch row or cache position is off by orders of magnitude more
        assert report["variants"]["native"][b]["check"]["median_rel_err"] < 64 * 2**-23
        assert "auto-compiles on CUDA only" in report["variants"]["native-generate+compile"][b]["skipped"]
    # bytes of one step: tiny OLMoE (2 layers, hidden 32, 8 experts x 3*32*16, top-3, head 256 x 32, 2 KV heads of 8)
    weights_1 = (2 * (3 * 32 * 32 + 8 * 32) + 256 * 32 + 2 * 3 * 3 * 32 * 16) * 4
    kv_1 = (8 + 2.5) * 2 * 2 * 2 * 8 * 4
    assert report["variants"]["native"]["1"]["step_bytes"]["total"] == pytest.approx(weights_1 + kv_1)
    for name in SERVE_GRAPH:
        for b in BATCHES:
            assert "CUDA graphs need a GPU" in report["variants"][name][b]["skipped"]
    rows = {(r["batch"], r["variant"]): r for r in report["table"]}
    assert rows[(4, "replicated")]["x_floor"] == pytest.approx(1.0) and rows[(1, "dedup")]["floor"] == "replicated"
    lines = res.stdout.strip().splitlines()
    assert (
        "| batch | variant | prefill ms | step ms p50 | step ms p99 | decode tok/s/GPU | e2e tok/s/GPU | x floor | "
        "native eager/this | native compiled/this | HBM share | capture/compile s |"
    ) in lines
    assert rows[(4, "native-generate")]["vs_native_eager"] == pytest.approx(1.0)
    assert rows[(4, "dedup")]["vs_native_eager"] == pytest.approx(
        rows[(4, "native-generate")]["ms_p50"] / rows[(4, "dedup")]["ms_p50"]
    )


def test_serve_verify_generation(tmp_path):
    out = tmp_path / "verify.json"
    res = _torchrun_serve(2, "--verify", "--model", "tiny-qwen3", "--new-tokens", "5", "--out", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    verify = json.loads(out.read_text())["verify"]
    assert set(verify) == {"tiny (float32)", "tiny-qwen3 (float32)"}
    for r in verify.values():  # CPU: no graph; eager generate == transformers' generate
        assert r["passed_all_ranks"] and r["eager_equals_transformers"] and "graph_equals_eager" not in r


def test_serve_bad_arguments_fail_clearly(capsys, monkeypatch):
    """Refused by serve.py's argument parsing (in this process: no interpreter start per case)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import serve

    for args, message in ((["--variants", "dedup,bogus"], "unknown variant"), (["--new-tokens", "0"], "must be >= 1")):
        with pytest.raises(SystemExit) as exit_info:
            serve.main(args)
        stderr = capsys.readouterr().err
        assert exit_info.value.code != 0 and message in stderr, stderr[-2000:]


def test_generate_timing_never_reports_a_negative_prefill(monkeypatch):
    """When later steps cost more than the average (or noise), generate(n) - (n - 1) marginal steps is negative:
    no prefill is reported then, the raw estimate is kept, and the table shows '-'."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _generate_runs as gr
    import serve

    calls = {4: 10.0, 2: 2.0}  # ms of generate(n): the marginal step (4 ms) exceeds the average
    monkeypatch.setattr(gr, "_wall_ms", lambda fn, device: (calls[fn()], None))
    monkeypatch.setattr(gr, "slowest", lambda values, device: values)
    res, _ = gr.time_generate(lambda ids, n: n, torch.zeros(1, 3), 4, 2, torch.device("cpu"))
    assert res["ms_p50"] == 4.0 and res["prefill_estimate_ms"] == 10.0 - 3 * 4.0 and res["prefill_ms_p50"] is None
    row = {"batch": 1, "variant": "generate", **res, "x_floor": None, "floor": None}
    assert serve.table([row]).splitlines()[-1].startswith("| 1 | generate | - | 4.00 |")
    calls.update({4: 14.0, 2: 8.0})  # a positive estimate is reported as it is
    res, _ = gr.time_generate(lambda ids, n: n, torch.zeros(1, 3), 4, 2, torch.device("cpu"))
    assert res["ms_p50"] == 3.0 and res["prefill_ms_p50"] == res["prefill_estimate_ms"] == 14.0 - 3 * 3.0


def test_variants_run_in_the_order_given(monkeypatch):
    """A job cut by a time limit keeps what was listed first: `--variants b,a` runs b first (the floor
    listed first is measured first); 'all' keeps the known order; a repeated name runs once."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import serve

    known = list(serve.VARIANTS)
    first, last = known[0], known[-1]
    assert serve.variant_list(f"{last},{first}") == [last, first]
    assert serve.variant_list(f"{last},{first},{last}") == [last, first]
    assert serve.variant_list("all") == known
