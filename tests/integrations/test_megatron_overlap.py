"""occult's dispatcher under Megatron-Core's combined-1F1B EP overlap (`overlap_moe_expert_parallel_comm`).

That schedule (`TransformerModelChunkSchedulePlan.run`) splits each layer into nodes (attention + router +
`dispatch_preprocess`, `token_dispatch`, experts, `token_combine`), detaches every node's inputs and frees the
dispatch node's inputs after its forward. On 2 gloo ranks, in one spawn:

1. a 2-layer GPTModel with occult's dispatcher run as micro-batch 0 forward, micro-batch 1 forward + micro-batch
   0 backward, micro-batch 1 backward gives every gradient of the plain forward/backward of both micro-batches;
2. benchmarks/megatron_train.py's own `run` trains a tiny GPTModel MoE (2 layers, fp32) for 3 steps of 4
   micro-batches through Megatron's `get_forward_backward_func()` for `alltoall`, `alltoall+overlap`, `occult`,
   `occult+overlap` and `occult+placement+grouped+overlap` (a random placement, occult's grouped experts,
   `TEGroupedMLP`: the weights renamed and moved to their placed ranks): every variant's
   per-step losses (mean over micro-batches and ranks) agree within the rounding of the step's terms, so the
   overlap trains what the plain schedule trains, for Megatron's dispatcher and occult's, with either expert
   module; the overlap variants went through schedule plans (one `build_schedule_plan` per micro-batch), the
   others did not; the JSON records micro-batches, overlap and expert module per variant; no variant's model is
   left alive after the run (so each variant's peak memory is its own).

Bad flags of the script (`--micro-batches 0`, the overlap with one micro-batch or one rank) stop it before any
work with one line naming the fix, exit status 2. CPU has no CUDA events, streams or NVTX: `cpu_shims` replaces
them with no-ops (the schedule's order is kept, not its concurrency; occult.integrations.megatron.cpu,
docs/overlap.md, last section).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Importing Megatron-Core imports Triton: with its CPU interpreter on, as the kernel tests collected after this
# module need it in this process (tests/kernels/_triton_interpreter.py; as in test_megatron.py).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 is installed by .ci/run (docs/testing.md)")

from occult.distributed import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "megatron_train.py"
STEPS, MICRO_BATCHES, SEQ = 3, 4, 16
VARIANTS = ("alltoall", "alltoall+overlap", "occult", "occult+overlap", "occult+placement+grouped+overlap")


def _bench():
    """benchmarks/megatron_train.py as a module."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    import megatron_train

    return megatron_train


def _plan_case(rank: int, world: int) -> list[str]:
    import megatron.core.pipeline_parallel.utils as pipeline_utils
    import test_megatron as tm  # (tests/integrations/test_megatron.py)
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan as Plan

    tm._megatron(world)  # cpu_shims: CUDA events, record_stream of CPU tensors and NVTX as no-ops
    pipeline_utils.set_streams()
    torch.manual_seed(0)
    settings = dict(num_layers=2, hidden_dropout=0.0, attention_dropout=0.0)
    plain = tm._gpt(tm._config(2, **settings), occult=True)
    config = tm._config(2, **settings, overlap_moe_expert_parallel_comm=True, bf16=True)
    config.bf16 = False  # asserted when the config is made; fp32 math keeps the comparison tight
    model = tm._gpt(config, occult=True)
    model.load_state_dict({k: v for k, v in plain.state_dict().items() if torch.is_tensor(v)})
    batches = [tm._tokens(7 + 100 * i, rank) for i in range(2)]
    for ids, pos, causal, labels in batches:
        plain(ids, pos, causal, labels=labels).sum().backward()
    plan0 = model.build_schedule_plan(*batches[0][:3], labels=batches[0][3])
    loss0 = Plan.run(plan0, None)
    plan1 = model.build_schedule_plan(*batches[1][:3], labels=batches[1][3])
    loss1 = Plan.run(plan1, plan0, b_grad=torch.ones_like(loss0))
    Plan.run(None, plan1, b_grad=torch.ones_like(loss1))
    errors: list[str] = []
    reference = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is None:
            errors.append(f"{name}: no gradient")
        else:
            tm._close(p.grad, reference[name].grad, f"{name} grad", errors)
    kinds = {type(m.token_dispatcher).__name__ for m in model.modules() if hasattr(m, "token_dispatcher")}
    if kinds != {"OccultTokenDispatcher"}:
        errors.append(f"dispatchers: {kinds}")
    return errors


def _train_case(rank: int, world: int, out: str, placement: str) -> dict:
    """The benchmark's training, every variant, counting the schedule plans built (by dispatcher) and the calls
    of Megatron's `finalize_model_grads` (the data-parallel gradient reduction the schedule ends with)."""
    import megatron.core.distributed as megatron_distributed
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    mt = _bench()
    plans: list[str] = []
    finalized: list[int] = []
    build_plan, finalize = GPTModel.build_schedule_plan, megatron_distributed.finalize_model_grads

    def counted_plan(self, *args, **kwargs):
        plans.append(type(self.decoder.layers[0].mlp.token_dispatcher).__name__)
        return build_plan(self, *args, **kwargs)

    def counted_finalize(*args, **kwargs):
        finalized.append(1)
        return finalize(*args, **kwargs)

    GPTModel.build_schedule_plan = counted_plan
    megatron_distributed.finalize_model_grads = counted_finalize
    args = mt.parse_args(
        ["--model", "tiny", "--layers", "2", "--seq", str(SEQ), "--steps", str(STEPS), "--warmup", "1"]
        + ["--micro-batches", str(MICRO_BATCHES), "--variants", ",".join(VARIANTS), "--out", out]
        + ["--placement", placement]
    )
    assert mt.check_args(args, world) is None
    parallel_state.destroy_model_parallel()  # the script sets up its own (after the plan case's)

    def models() -> int:
        gc.collect()
        return sum(isinstance(o, GPTModel) for o in gc.get_objects())

    before = models()
    variants = mt.run(args, world)["variants"]
    left = models() - before  # the script's models, each of which should be gone once its variant is timed
    return {"variants": variants, "plans": plans, "finalized": len(finalized), "models_left": left}


def _ranks(rank: int, world: int, out: str, placement: str) -> tuple[list[str], dict]:
    return _plan_case(rank, world), _train_case(rank, world, out, placement)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[list, Path]:
    import numpy as np

    from occult.placement import Placement

    folder = tmp_path_factory.mktemp("megatron_overlap")
    out, placement = folder / "megatron_train.json", folder / "placement.json"
    device_E = np.empty(8, dtype=np.int64)  # the tiny model's 8 experts, 4 a rank, in a random placement
    device_E[np.random.default_rng(int(torch.randint(0, 10_000, ()))).permutation(8)] = np.arange(8) // 4
    Placement(device_E[None], 2).save(str(placement))
    return run_ranks(_ranks, 2, str(out), str(placement)), out


def test_combined_1f1b_overlap_schedule_matches_plain_steps(ranks):
    for errors, _ in ranks[0]:
        assert errors == []


def test_benchmark_overlap_trains_what_the_plain_schedule_trains(ranks):
    results, out = ranks
    runs = results[0][1]["variants"]
    assert list(runs) == list(VARIANTS)
    for name, r in runs.items():
        assert (r["micro_batches"], r["overlap"]) == (MICRO_BATCHES, name.endswith("+overlap"))
        assert len(r["losses"]) == STEPS and all(4.0 < x < 6.0 for x in r["losses"])  # ~ln(vocab 128) = 4.85
    assert runs["occult+overlap"]["dispatcher"] == "OccultTokenDispatcher"
    assert runs["alltoall+overlap"]["dispatcher"] == "MoEAlltoAllTokenDispatcher"
    assert {n: (r["expert_module"], r["grouped_experts"]) for n, r in runs.items()} == {
        n: ("TEGroupedMLP(GroupedLinear)", True) if "+grouped" in n else ("SequentialMLP", False) for n in runs
    }
    for _, train in results:  # every micro-batch of the overlap variants went through a schedule plan, no other
        assert (
            sorted(train["plans"])
            == ["MoEAlltoAllTokenDispatcher"] * STEPS * MICRO_BATCHES
            + ["OccultTokenDispatcher"] * STEPS * MICRO_BATCHES * 2
        )
        assert train["finalized"] == len(VARIANTS) * STEPS  # gradients reduced once a step, after all micro-batches
        assert train["models_left"] == 0  # no variant's model, buffers or optimizer stayed (peak memory per variant)
    # A step's loss is the mean of 2 ranks x 4 micro-batches x 16 token losses near 4.9: summed in another order
    # it moves by at most that many roundings of its size (fp32); the updates before steps 1 and 2 differ by
    # roundings of the gradients only.
    terms = 2 * MICRO_BATCHES * SEQ
    tol = terms * torch.finfo(torch.float32).eps * max(abs(x) for x in runs["alltoall"]["losses"])
    for name, reference in (
        ("alltoall+overlap", "alltoall"),
        ("occult+overlap", "occult"),
        ("occult", "alltoall"),
        ("occult+placement+grouped+overlap", "occult+overlap"),
    ):
        gaps = [abs(a - b) for a, b in zip(runs[name]["losses"], runs[reference]["losses"], strict=True)]
        assert max(gaps) <= tol, f"{name} against {reference}: loss gaps {gaps} > {tol:.1e}"
    written = json.loads(out.read_text())["variants"]
    assert {n: (w["micro_batches"], w["overlap"], w["losses"]) for n, w in written.items()} == {
        n: (r["micro_batches"], r["overlap"], r["losses"]) for n, r in runs.items()
    }


def test_benchmark_bad_flags_stop_before_any_work_with_one_line():
    mt = _bench()

    def problem(world: int, *argv: str) -> str | None:
        return mt.check_args(mt.parse_args(["--model", "tiny", *argv]), world)

    assert problem(2, "--micro-batches", "0") == "--micro-batches must be >= 1, got 0"
    one = problem(2, "--variants", "alltoall,occult+overlap")  # --micro-batches 1, the default
    assert one.startswith("--variants occult+overlap: ") and "give --micro-batches >= 2" in one, one
    assert "run on 2 or more ranks" in problem(1, "--variants", "alltoall+overlap", "--micro-batches", "4")
    assert problem(2, "--variants", "occult+overlapp").startswith("--variants: unknown ['occult+overlapp']")
    assert problem(2, "--variants", "occult+overlap+grouped").startswith("--variants: unknown")  # grouped, then overlap
    assert "--placement is needed" in problem(2, "--variants", "occult+placement+overlap", "--micro-batches", "4")
    assert problem(2, "--variants", "alltoall+overlap,occult+overlap", "--micro-batches", "2") is None
    assert problem(2, "--micro-batches", "4") is None  # without the overlap any count
    # the script itself (one rank): one line on stderr, exit status 2, nothing run
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny", "--variants", "alltoall,occult+overlap"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"megatron_train.py: error: {one}"] and done.stdout == ""
