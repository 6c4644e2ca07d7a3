"""Re-placing experts while training: collect routing, solve in the background, migrate together.

Which experts are chosen together drifts as a model trains, so a placement solved once goes
stale. `Replacer(model, parallel, config)` (a `StepHook` of the training loop, made by `occult.lm.train.train` when
`TrainConfig.replace_every` or `replace_drift` is set) does, on every rank:

    collect   `RoutingSample`: a strided sample of each MoE layer's top-k ids on this rank, at
              most `replace_samples` tokens per layer in a ring buffer on the model's device (no
              host sync); the router's plain top-k when routing is device-limited (the pruned
              ids would make the current placement look perfect). It also sums C_T of the
              routed tokens under the placement in use: every `replace_check_every` steps one
              all-reduce gives the window's E[C_T] (logged to `replace.jsonl`; the drift signal).
    trigger   `replace_every` steps after the last decision (or the start), or when the window's E[C_T]
              exceeds the first window after the last decision by more than `replace_drift`
              (relative): one all-gather brings every rank's sample to every rank; rank 0 starts
              the solve (`occult.lm.solve_job.SolveJob` in a long-lived background process,
              started with training, so training goes on with the old placement; inline when
              `replace_wait`).
    decide    at each check step while a solve runs, rank 0 broadcasts one small tensor: not
              ready / keep / migrate to this placement. Every rank acts on the same step. The
              new placement is taken only if it lowers the sample's E[C_T] by at least
              `replace_min_gain` (relative) over the placement in use.
    migrate   `occult.lm.migrate.migrate`: expert weights and AdamW state to their new ranks in
              one all-to-all; routers follow.

`state()` / `load_state()` carry the placement in use and the schedule through checkpoints
(`train` stores them under the metadata key `replace`); the routing sample itself is not saved,
so the first solve after a resume sees only the steps since the resume.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from occult.lm.migrate import apply_placement, current_placement, migrate
from occult.lm.model import OccultLM
from occult.lm.parallel import Parallel
from occult.lm.solve_job import SolveJob, SolverProcess
from occult.moe.pruning import devices_per_token
from occult.placement import Placement
from occult.training.hooks import StepHook

LOG_FILE = "replace.jsonl"
NOT_READY, MIGRATE, KEEP, FAILED = 0, 1, 2, 3


class RoutingSample:
    """Bounded per-layer sample of routed top-k ids, and running C_T sums (see the module docstring)."""

    def __init__(self, model: OccultLM, capacity: int, per_step: int) -> None:
        self.model = model
        self.capacity, self.per_step = int(capacity), max(1, int(per_step))
        L, K = model.config.num_layers, model.config.top_k
        device = next(model.parameters()).device
        self.ids_LCK = torch.zeros(L, self.capacity, K, dtype=torch.int32, device=device)
        self.filled = [0] * L  # rows written since the last clear (host counters: no sync)
        self.ct_sum_L = torch.zeros(L, dtype=torch.float64, device=device)
        self.ct_count = [0] * L

    def observe(self, layer: int, logits_TE: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor) -> None:
        if not self.model.training or ids_TK.shape[0] == 0:
            return
        m = self.model.moe_layers()[layer]
        self.ct_sum_L[layer] += devices_per_token(ids_TK, m.expert_device_E).sum().double()
        self.ct_count[layer] += ids_TK.shape[0]
        if self.model.routing.max_devices is not None:  # sample what the router would choose unpruned
            ids_TK = logits_TE.topk(ids_TK.shape[1], dim=-1).indices
        stride = max(1, ids_TK.shape[0] // self.per_step)
        rows = ids_TK[::stride][: self.per_step]
        pos = torch.arange(self.filled[layer], self.filled[layer] + rows.shape[0], device=rows.device) % self.capacity
        self.ids_LCK[layer].index_copy_(0, pos, rows.to(torch.int32))
        self.filled[layer] += rows.shape[0]

    def tokens(self) -> int:
        return min(min(self.filled), self.capacity)

    def local(self) -> torch.Tensor:
        """[L, n, K] the sampled ids (ring order does not matter to a solver)."""
        return self.ids_LCK[:, : self.tokens()]

    def clear(self) -> None:
        self.filled = [0] * len(self.filled)

    def take_ct(self) -> tuple[torch.Tensor, list[int]]:
        sums, counts = self.ct_sum_L.clone(), list(self.ct_count)
        self.ct_sum_L.zero_()
        self.ct_count = [0] * len(self.ct_count)
        return sums, counts


class Replacer(StepHook):
    """Re-placement on every rank of `parallel` (see the module docstring): a hook of the training
    loop (`occult.training.hooks`), `after_step` after every optimizer step on every rank, between
    `start()` and `close()`."""

    def __init__(
        self,
        model: OccultLM,
        parallel: Parallel | None,
        cfg: Any,
        out_dir: str | Path | None = None,
        log: Callable[[str], None] | None = None,
        mode: str | None = None,
    ) -> None:
        if parallel is None or parallel.ep_size < 2:
            raise ValueError("re-placing experts needs them sharded over 2 or more ranks (torchrun, --ep-size >= 2)")
        spec = model.routing
        if spec.max_devices is not None and (spec.placement is None or spec.placement.num_devices != parallel.ep_size):
            raise ValueError(
                "re-placement with device-limited routing needs the routing placement on the "
                f"{parallel.ep_size} EP ranks "
                f"(it has {None if spec.placement is None else spec.placement.num_devices} devices)"
            )
        self.model, self.par, self.cfg, self.log = model, parallel, cfg, log
        self.out = Path(out_dir) / LOG_FILE if out_dir is not None and parallel.is_main else None
        self.mode = mode or ("inline" if cfg.replace_wait else "process")
        window = cfg.replace_every or cfg.replace_check_every
        self.sample = RoutingSample(model, cfg.replace_samples, math.ceil(cfg.replace_samples / window))
        self._ctx: Any = None
        self.last_solve = 0
        self.baseline: float | None = None
        self.migrations: list[dict] = []
        self.job: SolveJob | None = None
        self.server: SolverProcess | None = None
        self.pending_since: int | None = None  # step the running solve started (every rank knows)
        self.device = next(model.parameters()).device

    # ------------------------------------------------------------------ step
    def start(self) -> None:
        """Begin collecting routing (from the next forward on)."""
        if self._ctx is None:
            self._ctx = self.model.observe_routing(self.sample.observe)
            self._ctx.__enter__()
        if self.mode == "process" and self.par.is_main and self.server is None:
            self.server = SolverProcess()

    def after_step(self, step: int, optimizer: torch.optim.Optimizer | None) -> None:
        cfg = self.cfg
        check = step % cfg.replace_check_every == 0
        due = bool(cfg.replace_every) and self.pending_since is None and step - self.last_solve >= cfg.replace_every
        if check:
            ct = self._measure(step)
            if ct is not None and self.pending_since is None:
                if self.baseline is None:
                    self.baseline = ct
                elif cfg.replace_drift and ct > self.baseline * (1 + cfg.replace_drift):
                    due = True
                    self._note({"event": "drift", "step": step, "mean_ct": ct, "baseline": self.baseline})
        if due:
            self._start(step)
        if self.pending_since is not None and (check or cfg.replace_wait or due):
            self._decide(step, optimizer)

    def _measure(self, step: int) -> float | None:
        sums, counts = self.sample.take_ct()
        vals = torch.cat([sums, torch.tensor(counts, dtype=torch.float64, device=sums.device)])
        if self.par.world_size > 1:
            dist.all_reduce(vals, group=self.par.world_group)
        L = len(counts)
        s, c = vals[:L].tolist(), vals[L:].tolist()  # integer sums in float64: exact, equal on every rank
        if not sum(c):
            return None
        per_layer = [a / b if b else float("nan") for a, b in zip(s, c)]
        ct = sum(s) / sum(c)
        self._note({"event": "measure", "step": step, "mean_ct": ct, "layers": per_layer})
        return ct

    def _start(self, step: int) -> None:
        local = self.sample.local().contiguous()
        self.sample.clear()
        self.last_solve = step
        if local.shape[1] == 0:
            return
        parts = [torch.empty_like(local) for _ in range(self.par.world_size)]
        dist.all_gather(parts, local, group=self.par.world_group)
        self.pending_since = step
        self.baseline = None
        if self.par.is_main:
            ids = torch.cat(parts, 1).cpu().numpy()
            self._note({"event": "solve", "step": step, "tokens": int(ids.shape[1]), "mode": self.mode})
            cur = current_placement(self.model).expert_device_LE
            try:
                if self.mode == "process" and (self.server is None or self.server.failure() is not None):
                    self.server = SolverProcess()  # first solve without start(), or the process died
                self.job = SolveJob(
                    ids,
                    self.model.config.num_experts,
                    self.par.ep_size,
                    cur,
                    self.cfg.replace_method,
                    self.cfg.seed,
                    self.mode,
                    self.server,
                )
            except Exception as exc:  # told to every rank at the next decision, never raised on rank 0 alone
                self.job = _Failed(exc)

    def _decide(self, step: int, optimizer: torch.optim.Optimizer | None) -> None:
        L, E = self.model.config.num_layers, self.model.config.num_experts
        ctrl = torch.zeros(1 + L * E, dtype=torch.int64, device=self.device)
        info: dict[str, Any] = {}
        if self.par.is_main:
            flag, info = self._poll()
            ctrl[0] = flag
            if flag == MIGRATE:
                ctrl[1:] = torch.as_tensor(info["placement"].reshape(-1))
        if self.par.world_size > 1:
            dist.broadcast(ctrl, src=0, group=self.par.world_group)
        values = ctrl.tolist()
        flag = values[0]
        if flag == NOT_READY:
            return
        started, self.pending_since, self.job = self.pending_since, None, None
        self.last_solve = step  # the next solve is due `replace_every` steps after this decision
        self.baseline = None  # the drift reference: the next window, under the placement now in use
        event: dict[str, Any] = {
            "step": step,
            "solve_started": started,
            **{k: v for k, v in info.items() if k != "placement"},
        }
        if flag == MIGRATE:
            new = Placement(np.asarray(values[1:], dtype=np.int64).reshape(L, E), self.par.ep_size)
            stats = migrate(self.model, optimizer, new, self.par)
            event.update(
                event="migrate", experts_moved=stats.experts_moved, bytes_sent=stats.bytes_sent, migrate_s=stats.seconds
            )
            self.migrations.append(event)
        else:
            event["event"] = "keep" if flag == KEEP else "solver_failed"
        self._note(event)
        if self.log:
            self.log(_describe(event))

    def _poll(self) -> tuple[int, dict[str, Any]]:
        try:
            res = self.job.poll(block=bool(self.cfg.replace_wait))
        except Exception as exc:  # a failed solve keeps the placement; training goes on
            return FAILED, {"error": str(exc)[:300]}
        if res is None:
            return NOT_READY, {}
        old, new = float(res["old_ct"].mean()), float(res["new_ct"].mean())
        gain = 1.0 - new / old if old > 0 else 0.0
        info = {
            "old_ct": old,
            "new_ct": new,
            "gain": gain,
            "solve_s": float(res["seconds"]),
            "wall_s": time.perf_counter() - self.job.started,
        }
        info["placement"] = res["placement"]
        return (MIGRATE if gain >= self.cfg.replace_min_gain and gain > 0 else KEEP), info

    def _note(self, event: dict) -> None:
        if self.out is not None:
            with open(self.out, "a") as f:
                f.write(json.dumps({**event, "time": time.time()}) + "\n")

    # ----------------------------------------------------------- checkpoints
    def state(self) -> dict[str, Any]:
        """JSON-able: the placement in use and the schedule (what a checkpoint keeps)."""
        return {
            "placement": current_placement(self.model).to_json_dict(),
            "last_solve": self.last_solve,
            "baseline": self.baseline,
            "migrations": self.migrations,
        }

    def load_state(self, doc: dict[str, Any]) -> bool:
        """Restore `state()`; returns False (placement not applied) when it was for another EP size."""
        self.last_solve = int(doc.get("last_solve", 0))
        self.baseline = doc.get("baseline")
        self.migrations = list(doc.get("migrations", []))
        placement = Placement.from_json_dict(doc["placement"], "the checkpoint's placement")
        if placement.num_devices != self.par.ep_size:
            return False
        apply_placement(self.model, placement)
        return True

    def close(self) -> None:
        if self.job is not None:
            self.job.cancel()
            self.job = None
        if self.server is not None:
            self.server.close()
            self.server = None
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None


class _Failed:
    """A solve that could not start: its poll raises the error."""

    def __init__(self, exc: Exception) -> None:
        self.exc, self.started = exc, time.perf_counter()

    def poll(self, block: bool = False) -> None:
        raise self.exc

    def cancel(self) -> None:
        pass


def _describe(e: dict) -> str:
    head = f"step {e['step']}: re-placement solved (started at step {e['solve_started']})"
    if e["event"] == "solver_failed":
        return f"{head}: the solver failed ({e.get('error')}); keeping the placement"
    ct = f"E[C_T] {e['old_ct']:.3f} -> {e['new_ct']:.3f} ({100 * e['gain']:.1f}%), solve {e['solve_s']:.2f} s"
    if e["event"] == "keep":
        return f"{head}: {ct}; below the minimum gain, keeping the placement"
    return f"{head}: {ct}; migrated {e['experts_moved']} experts in {e['migrate_s'] * 1e3:.1f} ms"
