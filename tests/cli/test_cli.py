"""The `occult` command line: place / stats reports, JSON output, plots, clean errors, registry."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from occult import cli
from occult.placement import Placement
from occult.placement.stats import busiest_device_share, mean_ct
from occult.placement.synthetic import planted_trace

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A 3-layer planted trace on disk and its planted E[C_T] over all layers (4 devices)."""
    pt = planted_trace(6000, 64, 8, num_groups=4, num_layers=3, noise=0.1, skew=0.5, seed=np.random.default_rng())
    path = tmp_path_factory.mktemp("cli") / "trace.safetensors"
    pt.trace.save(path)
    p = pt.placement(4)
    opt = np.mean([mean_ct(pt.trace.layer(i), p.expert_device(i), 4) for i in range(3)])
    return path, opt


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_place_json_and_out(planted, tmp_path, capsys):
    trace, opt = planted
    out_path = tmp_path / "placement.json"
    code, out, err = run(capsys, "place", "--trace", trace, "--devices", 4, "--json", "--out", out_path)
    assert code == 0, err
    assert err == ""  # no progress bar when stderr is not a terminal
    rep = json.loads(out)
    assert rep["command"] == "place" and rep["method"] == "hypergraph" and rep["num_devices"] == 4
    assert len(rep["layers"]) == 3
    o = rep["overall"]
    assert o["placement"]["mean_ct"] <= 1.02 * opt
    assert o["baseline"]["mean_ct"] > 1.5 * o["placement"]["mean_ct"]
    assert o["reduction"] == pytest.approx(1 - o["placement"]["mean_ct"] / o["baseline"]["mean_ct"])
    assert o["placement"]["bytes_dedup"] == 2 * o["placement"]["rows_dedup"] * 2048 * 2
    assert o["placement"]["bytes_standard"] == 2 * 3 * 6000 * 8 * 2048 * 2
    for layer in rep["layers"]:
        assert set(layer["candidates"]) == {"contiguous", "greedy", "greedy+refine", "kahypar+refine"}
        assert layer["placement"]["mean_ct"] == pytest.approx(min(layer["candidates"].values()))
    p = Placement.load(out_path)
    assert p.num_layers == 3 and p.num_devices == 4
    doc = json.loads(out_path.read_text())
    assert doc["method"] == "hypergraph" and doc["mean_ct"] == [l["placement"]["mean_ct"] for l in rep["layers"]]


def test_place_text_then_stats_agree(planted, tmp_path, capsys):
    trace, _ = planted
    out_path = tmp_path / "greedy.json"
    code, out, _ = run(
        capsys,
        "place",
        "--trace",
        trace,
        "-d",
        4,
        "--method",
        "greedy",
        "-o",
        out_path,
        "--hidden",
        1024,
        "--dtype",
        "fp32",
    )
    assert code == 0
    assert "E[C_T] contiguous" in out and "E[C_T] greedy" in out and "overall" in out and f"wrote {out_path}" in out
    assert "busiest share" in out and "least sync_free_capacity" in out
    code, out, _ = run(capsys, "stats", "--trace", trace, "--placement", out_path, "--json", "--hidden", 1024)
    assert code == 0
    rep = json.loads(out)
    p = Placement.load(out_path)
    from occult.placement.trace import read_trace

    t = read_trace(trace)
    for i, layer in enumerate(rep["layers"]):
        assert layer["placement"]["mean_ct"] == pytest.approx(mean_ct(t.layer(i), p.expert_device(i), 4))
        assert sum(layer["placement"]["ct_hist"]) == 6000
        share = busiest_device_share(t.layer(i), p.expert_device(i), 4)
        assert layer["placement"]["busiest_device_share"] == pytest.approx(share)
    code, out, _ = run(capsys, "stats", "--trace", trace, "--devices", 4)
    assert code == 0 and "intra share" in out


def test_place_contiguous_and_load_bound(planted, capsys):
    trace, _ = planted
    code, out, _ = run(capsys, "place", "--trace", trace, "-d", 4, "--method", "contiguous", "--json")
    rep = json.loads(out)
    assert code == 0 and rep["overall"]["reduction"] == 0.0
    code, out, _ = run(capsys, "place", "--trace", trace, "-d", 4, "--max-load", "1.05", "--json")
    rep = json.loads(out)
    assert code == 0 and all(l["placement"]["load_imbalance"] <= 1.05 + 1e-9 for l in rep["layers"])


def test_place_nodes_then_stats(tmp_path, capsys):
    from occult.placement.synthetic import planted_nodes_trace

    pt = planted_nodes_trace(6000, 64, 8, num_nodes=2, groups_per_node=4, seed=1)
    trace, out_path = tmp_path / "nodes.safetensors", tmp_path / "nodes.json"
    pt.trace.save(trace)
    code, out, err = run(capsys, "place", "--trace", trace, "--devices", 8, "--nodes", 2, "-o", out_path)
    assert code == 0, err
    assert "E[N_T] contiguous" in out and "E[N_T] hypergraph" in out
    doc = json.loads(out_path.read_text())
    p = Placement.load(out_path)
    assert doc["num_nodes"] == 2 and p.num_nodes == 2 and len(doc["mean_nt"]) == 1
    truth = pt.placement(8, num_nodes=2)
    assert doc["mean_nt"][0] == pytest.approx(mean_ct(pt.trace.layer(0), truth.expert_node(0), 2))
    code, out, _ = run(capsys, "stats", "--trace", trace, "--placement", out_path, "--json")
    rep = json.loads(out)
    assert code == 0 and rep["num_nodes"] == 2
    assert rep["overall"]["placement"]["mean_nt"] == pytest.approx(doc["mean_nt"][0])
    code, out, _ = run(capsys, "stats", "--trace", trace, "--devices", 8, "--nodes", 2)
    assert code == 0 and "E[N_T] contiguous" in out
    code, _, err = run(capsys, "place", "--trace", trace, "--devices", 8, "--nodes", 3)
    assert code != 0 and "--nodes 3" in err
    code, _, err = run(capsys, "stats", "--trace", trace, "--placement", out_path, "--nodes", 4)
    assert code != 0 and "does not match" in err


def test_plot(planted, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    trace, _ = planted
    png = tmp_path / "heat.png"
    code, out, err = run(
        capsys,
        "place",
        "--trace",
        trace,
        "-d",
        4,
        "--method",
        "greedy",
        "--plot",
        png,
        "--plot-layers",
        "0,2",
        "--json",
    )
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out)["plotted_layers"] == [0, 2]
    code, _, err = run(capsys, "stats", "--trace", trace, "-d", 4, "--plot", tmp_path / "s.png", "--plot-layers", "7")
    assert code == 2 and "layer 7 is out of range" in err


def _assert_clean_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    assert err.startswith("occult: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err


def test_errors_are_clean(planted, tmp_path, capsys):
    trace, _ = planted
    code, _, err = run(capsys, "place", "--trace", tmp_path / "missing.safetensors", "-d", 4)
    _assert_clean_error(code, err, "does not exist")
    code, _, err = run(capsys, "place", "--trace", trace, "-d", 3)
    _assert_clean_error(code, err, "64 experts cannot be split evenly over 3 devices", "try 1, 2, 4")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(trace.read_bytes()[:100])
    code, _, err = run(capsys, "stats", "--trace", bad, "-d", 4)
    _assert_clean_error(code, err, "corrupted")
    ids = np.full((5, 8), 70, dtype=np.int16)
    save_file({"layers.0.topk_ids": ids}, str(bad), metadata={"num_experts": "64", "top_k": "8"})
    code, _, err = run(capsys, "place", "--trace", bad, "-d", 4)
    _assert_clean_error(code, err, "out of range [0, 64)")
    one_layer = tmp_path / "one.json"
    Placement.contiguous(64, 4).save(one_layer)
    code, _, err = run(capsys, "stats", "--trace", trace, "--placement", one_layer)
    _assert_clean_error(code, err, "1 layer(s), but the trace has 3")
    code, _, err = run(capsys, "stats", "--trace", trace, "--placement", one_layer, "--devices", 8)
    _assert_clean_error(code, err, "--devices 8 does not match")
    code, _, err = run(capsys, "stats", "--trace", trace)
    _assert_clean_error(code, err, "--placement FILE, or --devices D")
    code, _, err = run(capsys, "place", "--trace", trace, "-d", 4, "--dtype", "int3")
    _assert_clean_error(code, err, "--dtype int3: unknown dtype 'int3'")  # --max-load 0.9: tests/cli/test_usage.py


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["place", "--devices", "4"])
    assert exc.value.code == 2
    assert "the following arguments are required: --trace" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["place", "--trace", "x", "--devices", "0"])
    assert exc.value.code == 2


def test_registry_and_lazy_commands(capsys):
    calls = []

    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument("--n", type=int, default=1)

    def go(args: argparse.Namespace) -> int:
        calls.append(args.n)
        return 0

    parser = cli.build_parser([cli.Command("hello", "say hello", add, go)])
    args = parser.parse_args(["hello", "--n", "3"])
    assert args._run(args) == 0 and calls == [3]
    ghost = cli.lazy_command("ghost", "not installed", "occult._no_such_module")
    parser = cli.build_parser([ghost], chosen="ghost")
    args = parser.parse_args(["ghost"])
    with pytest.raises(cli.CommandError, match="'occult ghost' is not available"):
        args._run(args)
    names = [c.name for c in cli.COMMANDS]
    assert {"place", "stats", "demo"} <= set(names)
    p = cli.build_parser(chosen="demo")
    a = p.parse_args(["demo", "--world-size", "2", "--tokens", "64", "--steps", "1", "--backend", "gloo"])
    assert (a.world_size, a.tokens, a.steps, a.backend) == (2, 64, 1, "gloo")
    a = p.parse_args(["bench", "--tokens", "64,128", "--shapes", "tiny", "--variants", "dedup"])
    assert (a.tokens, a.shapes, a.variants) == ([64, 128], ["tiny"], ["dedup"])


def test_demo_and_bench_flags_do_not_import_the_tools():
    """Building `occult demo` / `occult bench` parsers (and --help) imports neither tool module."""
    code = (
        "import sys; from occult.cli import build_parser; p = build_parser(chosen='bench'); "
        "p.parse_args(['bench', '--tokens', '8']); p.parse_args(['demo']); "
        "print([m for m in ('occult.tools.demo', 'occult.tools.bench') if m in sys.modules])"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_cli_constants_mirror_the_library():
    from occult.cli import place as place_cli
    from occult.cli import tools as tools_cli
    from occult.placement import solvers as placement_solvers
    from occult.tools import bench

    assert place_cli.PLACE_METHODS == placement_solvers.METHODS
    assert place_cli.DEFAULT_KAHYPAR_TOKENS == placement_solvers.DEFAULT_KAHYPAR_TOKENS
    assert tools_cli.BENCH_SHAPES == tuple(bench.SHAPES) and tools_cli.BENCH_VARIANTS == bench.VARIANTS


def test_place_hypergraph_says_why_each_layer_chose_its_candidate(capsys):
    # Mt-KaHyPar on 2000 of each layer's 16384 tokens (default 8000): the report, not the solve, is checked here
    place = ["place", "--trace", REPO / "occult/data/example_trace.safetensors", "-d", 4, "--kahypar-tokens", 2000]
    code, out, err = run(capsys, *place)
    assert code == 0, err
    code, js, _ = run(capsys, *place, "--json")
    rep = json.loads(js)
    assert (
        "why chosen: hypergraph solves contiguous, greedy, greedy+refine, kahypar+refine and keeps the lowest E[C_T]"
        in out
    )
    why = [line for line in out.splitlines() if line.startswith("  layer ") and ": chosen " in line]
    assert len(why) == len(rep["layers"])
    for line, layer in zip(why, rep["layers"]):
        assert line.startswith(f"  layer {layer['layer']}: chosen {layer['winner']}: {layer['winner']} ")
        for name, value in layer["candidates"].items():
            assert f"{name} {value:.4f}" in line
        best = min(layer["candidates"].values())
        assert layer["candidates"][layer["winner"]] == best  # the reason given is the true one


def test_python_dash_m(planted):
    trace, _ = planted
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-m", "occult", "place", "--trace", str(trace), "-d", "2", "--method", "greedy", "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["num_devices"] == 2
    out = subprocess.run(
        [sys.executable, "-m", "occult", "place", "--trace", "/nonexistent", "-d", "2"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode == 2 and out.stderr.startswith("occult: error:") and "Traceback" not in out.stderr
