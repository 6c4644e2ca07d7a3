"""CPU smoke tests of the whole-model benchmark `benchmarks/e2e.py` (2 gloo ranks, tiny model)."""

from __future__ import annotations

import functools
import json
import os
import sys
import types

import pytest
import torch
from _bench_helpers import ROOT, python, torchrun  # tests/tools/_bench_helpers.py

pytest.importorskip("transformers")

SCRIPT = ROOT / "benchmarks" / "e2e.py"
VARIANTS = ("native", "replicated", "standard", "dedup", "dedup+placement", "pruned2", "pruned1")
EXACT = ("native", "replicated", "standard", "dedup", "dedup+placement")
PHASES = ("prefill", "train")
GPU_ONLY = ("replicated/graph", "dedup@syncfree/compile/stepgraph", "dedup@device")
_torchrun = functools.partial(torchrun, SCRIPT)


def test_e2e_tiny_every_variant_and_phase(tmp_path):
    out = tmp_path / "e2e.json"
    res = _torchrun(
        2,
        "--model",
        "tiny",
        "--batch",
        "2",
        "--seq",
        "32",
        "--check-seq",
        "32",
        "--warmup",
        "1",
        "--iters",
        "2",
        "--out",
        str(out),
        "--variants",
        ",".join(GPU_ONLY + VARIANTS),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    # the GPU-only variants: skipped on CPU with the reason, in the table too
    assert report["variants"].pop("replicated/graph")["skipped"] == "CUDA graphs need a GPU"
    assert report["variants"].pop("dedup@syncfree/compile/stepgraph")["skipped"] == "CUDA graphs need a GPU"  # a step
    assert (
        report["variants"]
        .pop("dedup@device")["skipped"]
        .startswith("the device transport cannot run here: no CUDA GPU")
    )
    assert "| dedup@device | - | skipped: the device transport cannot run here" in res.stdout
    assert report["env"]["world_size"] == 2
    assert "NCCL_P2P_DISABLE" in report["env"] and report["env"]["torch"] and report["env"]["transformers"]
    assert report["env"]["link"] == "cpu" and {"commit", "dirty", "date"} <= set(report["env"])  # run_record
    assert report["config"]["tokens_per_gpu"] == 64
    assert report["placement"]["mean_ct_placed"] <= report["placement"]["mean_ct_contiguous"] + 1e-9
    assert list(report["variants"]) == list(VARIANTS)
    for name, v in report["variants"].items():
        assert v["exact"] == (name in EXACT)
        if v["exact"]:  # fp32 on CPU: the converted model is the unconverted one up to rounding
            assert v["check"]["passed"] and v["check"]["median_rel_err"] < 1e-4, (name, v["check"])
            assert v["check"]["argmax_agreement"] == 1.0
        # the MoE backward before the timed train steps: 2 routers, the 2 norms in front of them and 1-3 sampled
        # experts' 2 weights in each layer (on rank 0 those it holds: all on one rank, maybe none of an EP layer's)
        checked = v["grad_check"]["params"]
        one_rank = name in ("native", "replicated")
        assert (8 if one_rank else 4) <= checked <= 16, (name, checked)
        assert not one_rank or checked == report["variants"]["native"]["grad_check"]["params"]  # the same sample
        assert v["grad_check"]["tol"] == pytest.approx(0.5)
        if v["exact"]:
            assert v["grad_check"]["passed"] and v["grad_check"]["max_rel_err"] < 1e-4, (name, v["grad_check"])
        assert v["loss"] == ("transformers ForCausalLMLoss" if name == "native" else "occult cross_entropy")
        for phase in PHASES:
            t = v["phases"][phase]
            assert 0 < t["ms_p10"] <= t["ms_median"] <= t["ms_p90"], (name, phase, t)
            assert len(t["ms_all"]) == 2 and t["tokens_per_s_per_gpu"] > 0
            assert 0 < t["ms_back_to_back_p10"] <= t["ms_back_to_back_median"] <= t["ms_back_to_back_p90"]
            calls = 2 * (2 if phase == "train" else 1)  # 2 MoE layers; a training step calls each twice
            assert t["host_ms_per_step"] > 0
            assert t["host_ms_per_moe_call"] == pytest.approx(t["host_ms_per_step"] / calls)
            assert t["mfu"] == pytest.approx(
                t["flops"] / (t["ms_median"] / 1e3) / 1e12 / report["peaks"]["matmul_tflops"]
            )
            if name == "native":  # the unconverted model: no occult layers, no rows reported
                assert t["comm"] == {}
                continue
            assert t["comm"]["forward_rows"] > 0
            assert (t["comm"]["backward_rows"] > 0) == (phase == "train")
    assert report["variants"]["native"]["check"]["median_rel_err"] == 0  # it is the reference model
    peaks, cost = report["peaks"], report["model_cost"]
    assert peaks["matmul_tflops"] > 0 and peaks["copy_gb_s"] > 0 and cost["moe_layers"] == 2
    # tiny OLMoE (hidden 32, 4 heads and 2 KV heads of 8, 8 experts x 16, top-3, 2 layers, vocab 256), by hand
    H, F, E, k, V, L, B, S = 32, 16, 8, 3, 256, 2, 2, 32
    active = L * (3 * H * H + E * H + k * 3 * H * F)  # q, o: H x H; k, v: H x H/2; router; top-k experts
    prefill = 2 * active * B * S + L * 4 * H * B * S * (S + 1) / 2 + 2 * V * H * B
    assert report["variants"]["native"]["phases"]["prefill"]["flops"] == pytest.approx(prefill)
    assert report["variants"]["native"]["phases"]["train"]["flops"] == pytest.approx(
        3 * (prefill + 2 * V * H * (B * S - B))
    )
    comm = {n: report["variants"][n]["phases"]["prefill"]["comm"] for n in ("replicated", "standard", "dedup")}
    assert comm["replicated"]["forward_remote_rows"] == 0  # the floor moves nothing between ranks
    assert comm["dedup"]["forward_rows"] < comm["standard"]["forward_rows"]
    last = res.stdout.strip().splitlines()
    assert last[-1].startswith("| pruned1 | train |") and any(
        line.startswith("| replicated | prefill |") for line in last
    )
    native_row = next(line for line in last if line.startswith("| native | prefill |")).split("|")
    assert native_row[6].strip() == "1.00" and native_row[7].strip().endswith("%")  # native/this, MFU
    assert float(native_row[4]) > 0  # back to back


def test_e2e_unknown_variant_fails_clearly(capsys):
    # the overlap schedules' /cN and /tbo variants were removed (issue 36): unknown now
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import e2e

    # and the chunked schedule's @chunksN (issue 36, session 8): unknown too
    for bad in (
        "dedup,bogus",
        "dedup/c0",
        "dedup/c2",
        "dedup/tbo",
        "replicated/tbo",
        "native/c2",
        "native/tbo",
        "hf-ep/c2",
        "hf-ep/compile",
        "dedup/tbo/c2",
        "torchtitan/tbo",
        "dedup@chunks4/layergraphs/compile",
        "dedup@chunks2",
    ):
        with pytest.raises(Exception, match="unknown variant") as info:
            e2e.variant_list(bad)
        assert bad.split(",")[-1] in str(info.value)
    with pytest.raises(SystemExit) as exit_info:  # the command line says it too (e2e.main: what the script runs)
        e2e.main(["--variants", "dedup/c2"])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and "unknown variant" in stderr and "dedup/c2" in stderr


def test_a_torchtitan_step_is_recorded_only_where_nothing_reads_back():
    """`/stepgraph` on a TorchTitan variant: TorchTitan's forward+backward recorded as its trainer records it, which
    holds only where no dispatcher or expert reads a count back to the host: occult's sync-free dispatcher with its
    fused experts (eager or /compile); TorchTitan's own all-to-all, occult's without the fused experts (the
    expert-major row count) and the device transport's host agreement are refused; it skips on CPU ranks."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import e2e

    good = "torchtitan+occult+experts@syncfree/stepgraph,torchtitan+occult+experts@syncfree/compile/stepgraph"
    assert e2e.variant_list(good) == good.split(",")
    for v in good.split(","):
        assert e2e.step_graph(v) and e2e.base_variant(v) == "torchtitan+occult+experts" and e2e.sync_free(v)
    assert e2e.is_compiled("torchtitan+occult+experts@syncfree/compile/stepgraph")
    assert e2e.unavailable("torchtitan+occult+experts@syncfree/stepgraph", torch.device("cpu")) is not None
    for bad in (
        "torchtitan/stepgraph",
        "torchtitan/compile/stepgraph",
        "torchtitan+occult@syncfree/stepgraph",
        "torchtitan+occult+experts/stepgraph",
        "torchtitan+occult+experts@device/stepgraph",
        "torchtitan+occult+experts@syncfree/stepgraph/compile",
        "torchtitan+occult+experts@syncfree/compile/stepgraph/deferwgrad",
    ):
        with pytest.raises(Exception, match="unknown variant"):
            e2e.variant_list(bad)


def test_deferwgrad_variants_set_the_setting_while_they_run(monkeypatch):
    """`/deferwgrad`: occult's variants, training ones (not prefill-only captures), OCCULT_DEFER_WGRAD=1 while
    the variant runs and the environment as it was after, an error or not."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import e2e

    from occult import settings

    good = "dedup@device/compile/stepgraph/deferwgrad,replicated/compile/deferwgrad,dedup@syncfree/compile/deferwgrad"
    assert e2e.variant_list(good) == good.split(",")
    assert e2e.base_variant("dedup@device/compile/stepgraph/deferwgrad") == "dedup"
    assert e2e.step_graph("dedup@device/compile/stepgraph/deferwgrad") and e2e.on_device("dedup@device/deferwgrad")
    for bad in ("native/compile/deferwgrad", "torchtitan/deferwgrad", "dedup@device/compile/graph/deferwgrad"):
        with pytest.raises(Exception, match="unknown variant"):
            e2e.variant_list(bad)
    monkeypatch.delenv("OCCULT_DEFER_WGRAD", raising=False)
    with e2e.variant_settings("dedup@device/compile/deferwgrad"):
        assert settings.current().defer_wgrad
    assert "OCCULT_DEFER_WGRAD" not in os.environ and not settings.current().defer_wgrad
    monkeypatch.setenv("OCCULT_DEFER_WGRAD", "0")
    with pytest.raises(RuntimeError, match="inside"):
        with e2e.variant_settings("replicated/compile/deferwgrad"):
            raise RuntimeError("inside")
    assert os.environ["OCCULT_DEFER_WGRAD"] == "0"
    with e2e.variant_settings("dedup@device/compile"):  # other variants: the environment as it is
        assert not settings.current().defer_wgrad


def test_tilegrid_variants_set_the_kernel_grid_while_they_run(monkeypatch):
    """`/tilegrid`: expert-parallel variants only, after /deferwgrad; OCCULT_KERNEL_GRID=tiles (with the deferral
    too where both are asked) while the variant runs, the environment as it was after; the variant is otherwise
    the one without it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import e2e

    from occult import settings

    both = "dedup@syncfree/compile/stepgraph/twobatch/deferwgrad/tilegrid"
    good = f"{both},dedup@syncfree/compile/interleave4/tilegrid,dedup@syncfree/compile/stepgraph/1f1b/tilegrid"
    assert e2e.variant_list(good) == good.split(",")
    assert e2e.split_settings(both) == (
        "dedup@syncfree/compile/stepgraph/twobatch",
        {"OCCULT_KERNEL_GRID": "tiles", "OCCULT_DEFER_WGRAD": "1"},
    )
    assert e2e.base_variant(both) == "dedup" and e2e.micro_batches(both) == 2 and e2e.step_graph(both)
    assert e2e.micro_batches("dedup@syncfree/compile/interleave4/tilegrid") == 4
    assert e2e.paired("dedup@syncfree/compile/stepgraph/1f1b/tilegrid")
    assert e2e.tile_grid(both) and e2e.deferred_wgrad(both) and not e2e.tile_grid("dedup@syncfree/compile")
    for bad in (
        "replicated/compile/tilegrid",
        "native/tilegrid",
        "torchtitan/tilegrid",
        "dedup@syncfree/compile/stepgraph/tilegrid/deferwgrad",  # (the settings' order)
    ):
        with pytest.raises(Exception, match="unknown variant"):
            e2e.variant_list(bad)
    monkeypatch.setenv("OCCULT_KERNEL_GRID", "persistent")
    monkeypatch.delenv("OCCULT_DEFER_WGRAD", raising=False)
    with e2e.variant_settings(both):
        assert settings.current().kernel_grid == "tiles" and settings.current().defer_wgrad
    assert os.environ["OCCULT_KERNEL_GRID"] == "persistent" and "OCCULT_DEFER_WGRAD" not in os.environ
    assert settings.current().kernel_grid == "persistent"


def test_e2e_experts_not_divisible_by_world_size_fails_clearly(tmp_path):
    res = _torchrun(3, "--model", "tiny", "--batch", "1", "--seq", "16", "--out", str(tmp_path / "x.json"))
    assert res.returncode != 0
    assert "not divisible by world size 3" in res.stdout + res.stderr
    assert not (tmp_path / "x.json").exists()


def test_e2e_exact_variant_off_exits_nonzero(tmp_path):
    # a negative tolerance: every exact variant "fails" its check (one rank: this exit path does not depend on it;
    # one plain process, the group of one that init_distributed makes without torchrun: no launcher to start)
    out = tmp_path / "e2e.json"
    res = python(
        SCRIPT,
        "--model",
        "tiny",
        "--variants",
        "dedup",
        "--phases",
        "prefill",
        "--batch",
        "1",
        "--seq",
        "16",
        "--check-seq",
        "16",
        "--tol",
        "-1",
        "--out",
        str(out),
    )
    assert res.returncode != 0
    assert "exact variant(s) dedup (logits) failed their checks against the unconverted model" in res.stderr
    report = json.loads(out.read_text())
    assert report["variants"]["dedup"]["check"]["passed"] is False and report["variants"]["dedup"]["phases"] == {}


def _torchtitan_missing() -> str | None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import tt_model
    finally:
        sys.path.pop(0)
    return tt_model.unavailable("qwen3_moe")


def test_e2e_torchtitan_whole_model_peer_matches_and_trains(tmp_path):
    """TorchTitan's own Qwen3-MoE at the same weights (EP + FSDP2 over 2 gloo ranks): its logits
    match the unconverted transformers model within bf16 (its experts compute in bf16; a wrong
    q/k/v or expert layout gives errors of order 1) and both phases are timed."""
    if (reason := _torchtitan_missing()) is not None:
        pytest.skip(reason)
    out = tmp_path / "e2e.json"
    res = _torchrun(
        2,
        "--model",
        "tiny-qwen3",
        "--variants",
        "dedup,torchtitan,torchtitan+occult,torchtitan+occult+experts",
        "--batch",
        "2",
        "--seq",
        "32",
        "--check-seq",
        "32",
        "--warmup",
        "1",
        "--iters",
        "1",
        "--out",
        str(out),
        timeout=400,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())["variants"]
    tt = report["torchtitan"]
    assert tt["exact"] and tt["check"]["passed"] and tt["check"]["median_rel_err"] < 2e-2, tt["check"]
    assert report["dedup"]["check"]["median_rel_err"] < 1e-4
    info = tt["torchtitan"]
    assert info["dispatcher"] == "AllToAllTokenDispatcher" and "EP" in info["parallelize"]
    assert info["local_experts"] * 2 == 8  # tiny-qwen3: 8 experts, half on each rank (EP over both)
    for phase in PHASES:
        assert tt["phases"][phase]["ms_median"] > 0 and tt["phases"][phase]["comm"] == {}
    occ = report["torchtitan+occult"]  # the same model with occult's dedup dispatcher: the same logits
    assert occ["torchtitan"]["dispatcher"] == "OccultTokenDispatcher" and occ["check"]["passed"], occ["check"]
    assert abs(occ["check"]["median_rel_err"] - tt["check"]["median_rel_err"]) < 1e-4, (occ["check"], tt["check"])
    for phase in PHASES:  # at most k rows per token and layer (2 x 32 tokens, top-2, 2 layers; exact: test_torchtitan)
        assert 0 < occ["phases"][phase]["comm"]["dispatch_rows"] <= 2 * 32 * 2 * 2, occ["phases"][phase]["comm"]
    fused = report["torchtitan+occult+experts"]  # occult's fused experts compute in fp32 here, TorchTitan's in bf16
    assert fused["torchtitan"]["experts"] == "OccultGroupedExperts" and fused["check"]["passed"], fused["check"]
    assert fused["check"]["median_rel_err"] < tt["check"]["median_rel_err"] / 4, (fused["check"], tt["check"])
    assert all(fused["phases"][phase]["ms_median"] > 0 for phase in PHASES)


def test_e2e_names_the_checks_a_variant_failed():
    """A run's error says which check failed: the logits can pass while a recorded step's replay does not."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import e2e
    finally:
        sys.path.pop(0)
    ok = {"check": {"passed": True, "logits_passed": True}, "phases": {}}
    replay = {
        "check": {"passed": False, "logits_passed": True},
        "phases": {"train": {"replay_check": {"passed": False}}},
    }
    backward = {"check": {"passed": False, "logits_passed": False}, "grad_check": {"passed": False}, "phases": {}}
    graph = {"check": {"passed": False, "logits_passed": True}, "graph": {"passed": False}, "phases": {}}
    assert e2e.failed_checks(replay) == ["train replay"]
    assert e2e.failed_checks(backward) == ["logits", "MoE backward"]
    assert e2e.failed_checks(graph) == ["prefill replay"]
    assert e2e.failed_checks({**ok, "check": {"passed": False}}) == ["logits"]  # (a report from before the split)


def test_e2e_torchtitan_peer_needs_qwen3_and_says_so():
    """The setup check refuses it (how `start_run` ends such a run, exit 2 and no output file, is shown end to end
    by test_e2e_experts_not_divisible_by_world_size_fails_clearly)."""
    if (reason := _torchtitan_missing()) is not None:
        pytest.skip(reason)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import e2e
    finally:
        sys.path.pop(0)
    args = e2e.parse_args(["--model", "tiny", "--variants", "torchtitan", "--batch", "1", "--seq", "16"])
    assert "use --model qwen3" in e2e.check_setup(args, e2e.model_config(args), 2)
    args = e2e.parse_args(["--model", "tiny", "--variants", "dedup", "--batch", "1", "--seq", "16"])
    assert e2e.check_setup(args, e2e.model_config(args), 2) is None
    recorded = "torchtitan+occult+experts@syncfree/stepgraph"  # (its one-rank replay is wrong on GPUs: refused there)
    args = e2e.parse_args(["--model", "tiny-qwen3", "--variants", recorded, "--batch", "1", "--seq", "16"])
    assert "run it on 2 or more ranks" in e2e.check_setup(args, e2e.model_config(args), 1)
    assert e2e.check_setup(args, e2e.model_config(args), 2) is None


def test_e2e_half_precision_checks_against_the_fp32_model_too(tmp_path):
    out = tmp_path / "e2e_bf16.json"
    res = python(  # one rank: a plain process (init_distributed's group of one), no torchrun launcher
        SCRIPT,
        "--model",
        "tiny-deepseek",
        "--dtype",
        "bf16",
        "--variants",
        "native,dedup",
        "--phases",
        "prefill,train",
        "--batch",
        "2",
        "--seq",
        "16",
        "--check-seq",
        "16",
        "--warmup",
        "1",
        "--iters",
        "1",
        "--out",
        str(out),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    variants = json.loads(out.read_text())["variants"]
    native = variants["native"]["check"]
    assert native["median_rel_err"] == 0 and native["fp32_median_rel_err"] == native["native_fp32_median_rel_err"] > 0
    assert variants["dedup"]["check"]["passed"] and "fp32_median_rel_err" in variants["dedup"]["check"]
    # the train phase's gradient check has the routers' and norms' fp32 gradients too (benchmarks/_grad_check.py)
    assert "bfloat16 gradients vs fp32, worst" in res.stdout + res.stderr, res.stdout[-3000:]
    for name in ("native", "dedup"):
        grads = variants[name]["grad_check"]
        assert grads["passed"] and grads["params"] > 0 and isinstance(grads["unchecked"], list), grads


def test_checked_passes_a_half_precision_variant_as_close_to_fp32_as_native(tmp_path):
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _timing import Truth, checked

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
        fp32_TV = torch.randn(64, 50, generator=gen)
        native_TV = fp32_TV + 0.1 * torch.randn(64, 50, generator=gen)  # ~10% off fp32 (routing flips)
        other_TV = fp32_TV + 0.1 * torch.randn(64, 50, generator=gen)  # as far, elsewhere: > tol from native
        truth = Truth(fp32_TV, native_TV)
        assert 0.05 < truth.native_err < 0.2
        assert not checked(other_TV, native_TV, 0.02)["passed"]  # without the fp32 model: fails
        res = checked(other_TV, native_TV, 0.02, truth)
        assert res["passed"] and res["native_fp32_median_rel_err"] == truth.native_err
        far_TV = fp32_TV + 0.2 * torch.randn(64, 50, generator=gen)  # 2x native's distance from fp32
        assert not checked(far_TV, native_TV, 0.02, truth)["passed"]
        assert checked(native_TV, native_TV, 0.02, truth)["passed"]
    finally:
        dist.destroy_process_group()


def test_e2e_transport_and_graph_modifiers():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import e2e

    ok = (
        "dedup@device,dedup@device/graph,replicated/graph,dedup+placement@device/compile,pruned2@device,standard@device"
    )
    names = e2e.variant_list(ok)
    assert [e2e.base_variant(v) for v in names] == [
        "dedup",
        "dedup",
        "replicated",
        "dedup+placement",
        "pruned2",
        "standard",
    ]
    assert [e2e.on_device(v) for v in names] == [True, True, False, True, True, True]
    assert [e2e.is_graphed(v) for v in names] == [False, True, True, False, False, False]
    assert e2e.variant_list("torchtitan+occult@device") == ["torchtitan+occult@device"]  # TorchTitan's seam too
    titan = e2e.variant_list(  # fixed capacity there; /compile: TorchTitan's blocks compiled, either dispatcher
        "torchtitan+occult@syncfree,torchtitan+occult+experts@syncfree/compile,torchtitan/compile"
    )
    assert [(e2e.base_variant(v), e2e.sync_free(v), e2e.is_compiled(v)) for v in titan] == [
        ("torchtitan+occult", True, False),
        ("torchtitan+occult+experts", True, True),
        ("torchtitan", False, True),
    ]
    free = e2e.variant_list("dedup@syncfree/layergraphs/compile,standard@syncfree/graph,dedup")  # sync-free dispatch
    assert [(e2e.base_variant(v), e2e.sync_free(v), e2e.on_device(v)) for v in free] == [
        ("dedup", True, False),
        ("standard", True, False),
        ("dedup", False, False),
    ]
    assert [(e2e.layer_graphs(v), e2e.is_graphed(v), e2e.is_compiled(v)) for v in free] == [
        (True, False, True),
        (False, True, False),
        (False, False, False),
    ]
    both = e2e.variant_list("dedup@device/compile/graph,replicated/compile/graph")  # compiled layers, captured
    assert [e2e.base_variant(v) for v in both] == ["dedup", "replicated"]
    assert [(e2e.on_device(v), e2e.is_compiled(v), e2e.is_graphed(v)) for v in both] == [
        (True, True, True),
        (False, True, True),
    ]
    for bad in (
        "dedup/graph",
        "replicated@device",
        "native@device",
        "torchtitan@device",
        "dedup@device/tbo",
        "replicated@syncfree",
        "native@syncfree",
        "torchtitan@syncfree",
        "hf-ep@device",
        "hf-ep@syncfree",
        "hf-ep/compile",
        "torchtitan/compile/graph",
        "torchtitan+occult@syncfree/compile/stepgraph",
        "torchtitan+occult/graph",
        "dedup/compile/graph",
        "native/compile/graph",
        "dedup@device/graph/compile",
        "dedup@device/twobatch",  # two interleaved micro-batches: sync-free layers only
        "replicated/compile/twobatch",
        "dedup@syncfree/twobatch/compile",
        "dedup@device/interleave3",  # K interleaved micro-batches: sync-free, 2-16, prefill only
        "dedup@syncfree/interleave1",
        "dedup@syncfree/interleave17",
        "dedup@syncfree/compile/stepgraph/interleave3",
        "dedup@syncfree/interleave3/deferwgrad",
    ):
        with pytest.raises(Exception, match="unknown variant"):
            e2e.variant_list(bad)
    two = e2e.variant_list(
        "dedup@syncfree/compile/twobatch,dedup@syncfree/twobatch,dedup@syncfree/graph,dedup@syncfree/compile/interleave4"
    )
    assert [(e2e.base_variant(v), e2e.is_graphed(v), e2e.micro_batches(v), e2e.is_compiled(v)) for v in two] == [
        ("dedup", True, 2, True),
        ("dedup", True, 2, False),
        ("dedup", True, 1, False),
        ("dedup", True, 4, True),
    ]
    assert e2e.parse_args(["--variants", "dedup@syncfree/interleave4", "--batch", "8"]).batch == 8
    with pytest.raises(SystemExit):  # --batch 6 does not split in 4 (argparse's message, exit 2)
        e2e.parse_args(["--variants", "dedup@syncfree/interleave4", "--batch", "6"])


def test_native_compile_compiles_the_decoder_layers(monkeypatch):
    """`native/compile` is transformers' own model with its decoder layers compiled (from 64c08ba to this test's
    commit it returned the model uncompiled: every "transformers + compile_layers" figure of e2e.py and
    scripts/profile_model.py in that span timed plain eager transformers)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import e2e

    calls = []
    monkeypatch.setattr(e2e.hf, "compile_layers", lambda model, **kw: calls.append((model, kw)))
    model = object()
    assert e2e.convert_variant(model, "native/compile", None, None) is model
    assert calls == [(model, {"layer_graphs": True, "train_graphs": False, "trace_moe": None})]
    assert e2e.convert_variant(model, "native", None, None) is model and len(calls) == 1


def _compile_layers_calls(monkeypatch, e2e, variant: str) -> list[dict]:
    """The keywords `convert_variant` hands `hf.compile_layers` for `variant` (conversion stubbed out)."""
    calls = []
    monkeypatch.setattr(e2e.hf, "compile_layers", lambda model, **kw: calls.append(kw))
    monkeypatch.setattr(e2e.hf, "convert", lambda model, **kw: model)
    monkeypatch.setattr(e2e, "set_sync_free", lambda model, enabled=True: 0)
    e2e.convert_variant(torch.nn.Module(), variant, None, None)
    return calls


def test_eagermoe_goes_with_replicated_compile_only(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import e2e

    (name,) = e2e.variant_list("replicated/eagermoe/compile")
    assert e2e.eager_moe(name) and e2e.is_compiled(name) and e2e.base_variant(name) == "replicated"
    assert not e2e.eager_moe("replicated/compile")
    calls = _compile_layers_calls(monkeypatch, e2e, name)
    assert calls == [{"layer_graphs": True, "train_graphs": False, "trace_moe": False}]
    for bad in (
        "replicated/eagermoe",
        "dedup@device/eagermoe/compile",
        "native/eagermoe/compile",
        "replicated/tracemoe/compile",
    ):
        with pytest.raises(Exception, match="unknown variant"):
            e2e.variant_list(bad)


def test_tracemoe_goes_with_sync_free_compiled_variants_of_one_micro_batch(monkeypatch):
    """'/tracemoe': compile_layers(trace_moe=True) for sync-free expert-parallel variants, with a recorded step or
    not; refused where the layers learn their sizes at run time, with several micro-batches, or with the settings a
    traced backward ignores."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import e2e

    names = e2e.variant_list("dedup@syncfree/tracemoe/compile,dedup@syncfree/tracemoe/compile/stepgraph")
    for name in names:
        assert e2e.traced_moe(name) and e2e.is_compiled(name) and e2e.sync_free(name) and not e2e.eager_moe(name)
    assert e2e.step_graph(names[1]) and not e2e.traced_moe("dedup@syncfree/compile")
    calls = _compile_layers_calls(monkeypatch, e2e, names[1])
    assert calls == [{"layer_graphs": False, "train_graphs": False, "trace_moe": True}]
    for bad in (
        "dedup/tracemoe/compile",
        "dedup@device/tracemoe/compile",
        "replicated/tracemoe/compile",
        "dedup@syncfree/tracemoe",
        "dedup@syncfree/tracemoe/compile/stepgraph/twobatch",
        "dedup@syncfree/tracemoe/compile/stepgraph/deferwgrad",
        "dedup@syncfree/tracemoe/compile/stepgraph/tilegrid",
        "dedup@syncfree/tracemoe/traingraphs/compile",
    ):
        with pytest.raises(Exception, match="unknown variant"):
            e2e.variant_list(bad)


class _TinyLM(torch.nn.Module):
    """A transformers-like causal LM whose loss is its embeddings' mean square (train steps without a model)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)

    def forward(self, input_ids, labels, use_cache):
        return types.SimpleNamespace(loss=self.embed(input_ids).square().mean())


def test_stepgraph_records_the_train_step_with_the_moe_layers_eager_inside(monkeypatch):
    """`/stepgraph`: compile_layers leaves the MoE layers' own graphs off (they are recorded inside the step), and
    the train step goes through `StepGraph` (3 eager steps, then the recording); only occult's variants that
    can be recorded, not with the other graph modifiers."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import e2e

    names = e2e.variant_list("replicated/compile/stepgraph,dedup@device/compile/stepgraph,dedup@syncfree/stepgraph")
    assert all(e2e.step_graph(n) for n in names) and not e2e.step_graph("replicated/compile")
    assert [e2e.base_variant(n) for n in names] == ["replicated", "dedup", "dedup"] and e2e.on_device(names[1])
    calls = _compile_layers_calls(monkeypatch, e2e, names[0])
    assert calls == [{"layer_graphs": False, "train_graphs": False, "trace_moe": None}]
    for bad in (
        "native/compile/stepgraph",
        "dedup/compile/stepgraph",
        "dedup@device/traingraphs/compile/stepgraph",
        "replicated/layergraphs/stepgraph",
        "replicated/compile/stepgraph/graph",
    ):
        with pytest.raises(Exception, match="unknown variant"):
            e2e.variant_list(bad)
    seen = []

    class Recorder:
        def eager(self, body, batch):
            seen.append("eager")
            return body(batch)

        def prepare(self, optimizer): ...

        def record(self, body, inputs):
            seen.append("record")
            self.body, self.inputs = body, inputs

        def replay(self):
            seen.append("replay")
            return self.body(self.inputs)

        def statuses(self):
            return []

        def release(self): ...

    monkeypatch.setattr(e2e, "CudaRecorder", lambda device: Recorder())
    monkeypatch.setattr(e2e.hf, "sync_gradients", lambda model, average=True, complete=(): None)

    model = _TinyLM()
    step = e2e.make_step(model, "train", torch.optim.AdamW(model.parameters()), captured=True)
    for _ in range(5):
        step(torch.randint(0, 11, (2, 3)))
    assert seen == ["eager"] * 3 + ["record", "replay", "replay"]


def test_stepgraph_twobatch_trains_the_recorded_step_as_two_interleaved_halves(monkeypatch):
    """`/stepgraph/twobatch`: @syncfree variants only; the train step's forward and backward as the batch's two
    halves through `occult.training.two_batch.interleaved_backward` (its mean loss), recorded like any /stepgraph
    step; its prefill is the captured two-batch forward (/twobatch); /deferwgrad after it (not after a prefill-only
    /twobatch)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import e2e

    (name,) = e2e.variant_list("dedup@syncfree/compile/stepgraph/twobatch")
    assert e2e.step_graph(name) and e2e.micro_batches(name) == 2 and e2e.is_graphed(name)
    assert e2e.base_variant(name) == "dedup" and e2e.is_compiled(name)
    (deferred,) = e2e.variant_list("dedup@syncfree/compile/stepgraph/twobatch/deferwgrad")
    assert e2e.deferred_wgrad(deferred) and e2e.micro_batches(deferred) == 2 and e2e.step_graph(deferred)
    for bad in (
        "dedup@device/compile/stepgraph/twobatch",  # the device transport: one exchange in flight
        "replicated/compile/stepgraph/twobatch",
        "dedup@syncfree/compile/stepgraph/graph",
        "dedup@syncfree/compile/twobatch/deferwgrad",  # prefill only without /stepgraph
    ):
        with pytest.raises(Exception, match="unknown variant"):
            e2e.variant_list(bad)
    halves_seen = []

    def interleaved(model, loss_of, halves):
        halves_seen.append([tuple(h.shape) for h in halves])
        loss = (loss_of(halves[0]) + loss_of(halves[1])) / 2
        loss.backward()
        return loss.detach()

    monkeypatch.setattr(e2e, "interleaved_backward", interleaved)
    monkeypatch.setattr(e2e.hf, "sync_gradients", lambda model, average=True, complete=(): None)

    model = _TinyLM()
    ids = torch.randint(0, 11, (4, 3))
    (loss,) = e2e.make_step(model, "train", torch.optim.SGD(model.parameters(), lr=0.0), micro_batches=2)(ids)
    assert halves_seen == [[(2, 3), (2, 3)]]
    torch.testing.assert_close(loss, model.embed(ids).square().mean().detach())
    assert model.embed.weight.grad is not None


def test_accumulate_and_1f1b_split_the_train_step_into_micro_batches(monkeypatch, capsys):
    """`--accumulate K`: the train step's batch as K micro-batches, their gradients accumulated (in turn; paired for
    `/1f1b`, @syncfree variants only); every flag that cannot go with it refused before any work."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import e2e

    (name,) = e2e.variant_list("dedup@syncfree/compile/stepgraph/1f1b/deferwgrad")
    assert e2e.paired(name) and e2e.step_graph(name) and e2e.deferred_wgrad(name) and not e2e.is_graphed(name)
    assert e2e.base_variant(name) == "dedup" and e2e.sync_free(name) and e2e.micro_batches(name) == 1
    for bad in (
        "dedup@device/compile/stepgraph/1f1b",
        "replicated/compile/stepgraph/1f1b",
        "dedup@syncfree/twobatch/1f1b",
    ):
        with pytest.raises(Exception, match="unknown variant"):
            e2e.variant_list(bad)
    args = e2e.parse_args(
        ["--variants", "replicated/compile,dedup@syncfree/compile/1f1b", "--batch", "8", "--accumulate", "4"]
    )
    assert args.accumulate == 4
    for argv, why in (
        (["--batch", "6", "--accumulate", "4"], "divides --batch"),
        (["--batch", "8", "--variants", "dedup@syncfree/compile/1f1b"], "give --accumulate 2 or more"),
        (
            ["--batch", "8", "--accumulate", "2", "--variants", "dedup@syncfree/compile/stepgraph/twobatch"],
            "choose one",
        ),
        (["--batch", "8", "--accumulate", "2", "--variants", "replicated,torchtitan"], "leave the torchtitan"),
    ):
        with pytest.raises(SystemExit):
            e2e.parse_args(argv)
        assert why in capsys.readouterr().err, argv
    seen = []

    def accumulate(model, loss_of, micro, paired, unsynced):
        seen.append(([tuple(m.shape) for m in micro], paired))
        return e2e_accumulate(model, loss_of, micro, paired, unsynced)

    from occult.training.accumulation import accumulate_backward as e2e_accumulate

    monkeypatch.setattr(e2e, "accumulate_backward", accumulate)
    monkeypatch.setattr(e2e.hf, "sync_gradients", lambda model, average=True, complete=(): None)
    ids = torch.randint(0, 11, (4, 3))
    want = None
    for pair in (False, True):
        torch.manual_seed(3)
        model = _TinyLM()
        (loss,) = e2e.make_step(model, "train", torch.optim.SGD(model.parameters(), lr=0.0), accumulate=2, pair=pair)(
            ids
        )
        torch.testing.assert_close(loss, model.embed(ids).square().mean().detach())
        grad = model.embed.weight.grad.clone()
        want = grad if want is None else want
        torch.testing.assert_close(grad, want, rtol=1e-6, atol=1e-8)
    assert seen == [([(2, 3), (2, 3)], False), ([(2, 3), (2, 3)], True)]


def test_e2e_tiny_accumulated_steps_in_turn_and_paired(tmp_path):
    """The whole e2e.py path on 2 gloo ranks with --accumulate 2: the floor and sync-free dedup accumulate in turn,
    /1f1b pairs the micro-batches (each next forward with the previous backward), also with /tilegrid, every variant
    trains and books both micro-batches' rows."""
    out = tmp_path / "acc.json"
    res = _torchrun(
        2,
        *("--model", "tiny", "--batch", "4", "--seq", "16", "--check-seq", "16", "--warmup", "1", "--iters", "2"),
        *("--phases", "train", "--accumulate", "2", "--out", str(out)),
        *("--variants", "replicated,dedup@syncfree,dedup@syncfree/1f1b,dedup@syncfree/1f1b/tilegrid"),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["config"]["accumulate"] == 2
    rows = {}
    for name, v in report["variants"].items():
        t = v["phases"]["train"]
        assert t["ms_median"] > 0 and v["check"]["passed"], (name, v)
        rows[name] = t["comm"].get("backward_rows")
    assert rows["dedup@syncfree/1f1b"] == rows["dedup@syncfree"] > 0  # the same rows, paired or in turn
    assert rows["dedup@syncfree/1f1b/tilegrid"] == rows["dedup@syncfree"]  # (/tilegrid: a setting, the same step)
    for v in report["variants"].values():  # two micro-batches: each layer called forward and backward twice
        t = v["phases"]["train"]
        assert t["host_ms_per_moe_call"] == pytest.approx(t["host_ms_per_step"] / (2 * 2 * 2))
    assert any(line.startswith("| dedup@syncfree/1f1b | train |") for line in res.stdout.splitlines())


def test_train_optimizer_is_what_each_side_runs(monkeypatch):
    """--optimizer adamw: occult's AdamW for occult's variants, torch's for transformers' own; adamw-torch: torch's
    for every variant; sgd: SGD."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import e2e

    from occult.training.optim import AdamW

    model, cpu = torch.nn.Linear(3, 2), torch.device("cpu")
    for optimizer, variant, kind in [
        ("adamw", "replicated/compile/stepgraph", AdamW),
        ("adamw", "dedup@device/compile", AdamW),
        ("adamw", "native/compile", torch.optim.AdamW),
        ("adamw-torch", "replicated/compile", torch.optim.AdamW),
        ("sgd", "replicated", torch.optim.SGD),
    ]:
        args = e2e.parse_args(["--optimizer", optimizer, "--lr", "0.5"])
        opt = e2e.train_optimizer(model, variant, args, cpu)
        assert type(opt) is kind and opt.param_groups[0]["lr"] == 0.5, (optimizer, variant)


def test_train_loss_is_what_each_side_runs(monkeypatch):
    """--loss occult: occult's cross-entropy for occult's variants, transformers' for its own; --loss transformers:
    transformers' for every variant."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import e2e
    from transformers.loss.loss_utils import LOSS_MAPPING

    from occult.integrations import hf
    from occult.training.loss import causal_lm_loss

    for loss, variant, ours in [
        ("occult", "replicated/compile/stepgraph", True),
        ("occult", "dedup@host/compile", True),
        ("occult", "native/compile", False),
        ("occult", "hf-ep", False),
        ("transformers", "replicated/compile", False),
    ]:
        model = hf.tiny_random_model("olmoe", seed=0)
        name = e2e.train_loss(model, variant, e2e.parse_args(["--loss", loss]))
        assert model.loss_function is (causal_lm_loss if ours else LOSS_MAPPING["ForCausalLM"]), (loss, variant)
        assert name == ("occult cross_entropy" if ours else "transformers ForCausalLMLoss")


def test_comm_stats_of_a_two_batch_step_count_both_halves(monkeypatch):
    """A layer keeps its last call's row counts: a step of two interleaved halves calls it twice, so its rows are
    estimated as twice the last half's (and say so), not reported as the half's."""
    import types

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import e2e

    stats = types.SimpleNamespace(forward_rows=10, forward_remote_rows=4)
    blocks = [("l0", types.SimpleNamespace(experts=types.SimpleNamespace(last_comm_stats=stats)))] * 3
    monkeypatch.setattr(e2e.hf, "moe_blocks", lambda model: blocks)
    monkeypatch.setattr(e2e.dist, "all_reduce", lambda t: None)
    monkeypatch.setattr(e2e.dist, "get_world_size", lambda: 1)
    one = e2e.comm_stats(None, torch.device("cpu"))
    two = e2e.comm_stats(None, torch.device("cpu"), calls_per_step=2)
    assert one == {"forward_remote_rows": 12.0, "forward_rows": 30.0}
    assert two == {"forward_remote_rows": 24.0, "forward_rows": 60.0, "calls_per_step": 2}


def _dense_sync_rank(rank: int, world: int, seed: int) -> dict:
    """One backward of a tiny converted OLMoE (experts over both ranks), its gradients averaged after the backward
    and, on a copy, in buckets during it (`--dense-sync overlap`)."""
    import copy

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import e2e

    from occult.integrations import hf

    base = hf.tiny_random_model("olmoe", seed=seed, vocab_size=64)
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(seed + rank))
    grads = {}
    for how in ("after", "overlap"):
        model = hf.convert(copy.deepcopy(base), dispatcher="dedup")
        sync = e2e.gradient_sync(model, how)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        sync.finish()
        grads[how] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for how in ("after", "overlap"):  # two accumulated micro-batches, the first backward held: the same gradients
        model = hf.convert(copy.deepcopy(base), dispatcher="dedup")
        sync = e2e.gradient_sync(model, how)
        e2e.accumulate_backward(
            model, lambda m: model(input_ids=m, labels=m, use_cache=False).loss, ids.chunk(2), unsynced=sync.unsynced
        )
        sync.finish()
        grads[f"{how}_x2"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    errors = {n: float((grads["overlap"][n] - g).abs().max()) for n, g in grads["after"].items()}
    errors.update({f"x2 {n}": float((grads["overlap_x2"][n] - g).abs().max()) for n, g in grads["after_x2"].items()})
    return errors


def test_dense_sync_overlap_gives_the_gradients_of_the_sync_after_the_backward():
    """`--dense-sync overlap`: the replicated gradients all-reduced in buckets during the backward, the experts'
    divided, as `hf.sync_gradients` leaves them after it (gloo: bit for bit); with `--accumulate 2` too (the first
    micro-batch's backward inside the buckets' `held()`)."""
    pytest.importorskip("transformers")
    from occult.distributed import run_ranks

    for rank, errors in enumerate(run_ranks(_dense_sync_rank, 2, 5, timeout_s=180)):
        assert errors and max(errors.values()) == 0.0, (rank, {n: e for n, e in errors.items() if e})
