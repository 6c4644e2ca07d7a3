"""`occult train --compile` (`OccultLM.compile_dense`): each block's dense half compiled by Inductor, the MoE
layers eager; a compiled run trains as the eager one does, in one process and on 2 ranks (EP over both, FSDP2)."""

from __future__ import annotations

import random

from _train_helpers import PLACEMENT, assert_matches, load_tiny, one_process, run, train_config

from occult import Placement
from occult.distributed import run_ranks

CLOSE = 1e-4  # Inductor's fused fp32 kernels round differently from eager's


def test_compiled_blocks_train_like_eager(tmp_path, data):
    seed = random.randrange(2**31)
    c = dict(steps=5, eval_every=5, save_every=0)
    eager = one_process(data, train_config(**c), tmp_path / "eager", seed)
    compiled = one_process(data, train_config(**c, compile=True), tmp_path / "compiled", seed)
    assert_matches(compiled, eager, CLOSE, steps=5)


def fsdp_worker(rank: int, world: int, out: str, seed: int) -> dict:
    from pathlib import Path

    from occult.training.parallel import setup_parallel

    par = setup_parallel(ep_size=2)
    c = dict(steps=5, eval_every=5, save_every=0, grad_sync="fsdp", compile=True)
    return run(par, load_tiny(), Path(out) / f"r{rank}", Placement.from_lists(PLACEMENT, 2), seed, config=c)


def test_compiled_blocks_under_fsdp2_on_two_ranks_train_like_one_process(tmp_path, data):
    """FSDP2's hooks stay on the block, outside the compiled half: the same run as one eager process."""
    seed = random.randrange(2**31)
    eager = one_process(data, train_config(steps=5, eval_every=5, save_every=0), tmp_path / "one", seed)
    for got in run_ranks(fsdp_worker, 2, str(tmp_path), seed, timeout_s=600):
        assert_matches(got, eager, CLOSE, steps=5)


def test_compile_setting_and_cli():
    from occult.cli import build_parser
    from occult.cli.lm import _train_config
    from occult.lm.state import TrainConfig

    assert "compile" in TrainConfig.LOGGING_FIELDS and TrainConfig().compile is False  # may change on resume
    assert _train_config(build_parser().parse_args(["train", "--out", "x", "--compile"])).compile is True
    assert _train_config(build_parser().parse_args(["train", "--out", "x"])).compile is False


def test_compile_dense_compiles_every_block_and_leaves_the_moe_layers_eager(data):
    import torch
    from _train_helpers import config
    from torch._dynamo.utils import counters

    from occult.lm.model import OccultLM

    model = OccultLM(config(data))
    torch._dynamo.reset()
    counters.clear()
    assert model.compile_dense(backend="eager") == len(model.blocks)
    ids = torch.randint(data.vocab_size, (2, 16))
    model(ids, ids).loss.backward()
    assert all(b.compiled_half is not None for b in model.blocks)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters)
