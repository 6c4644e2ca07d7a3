"""Placement solvers: choose, per layer, which device holds which expert to lower E[C_T].

- `contiguous`: experts [d*E/D, (d+1)*E/D) on device d, the layout every framework uses (baseline).
- `greedy`: the paper's clustering on the pairwise co-activation matrix. Device 0 is seeded
  with the most co-activated pair, a device grows with the unplaced expert of highest mean
  co-activation with its members, and the next device is seeded with the unplaced expert
  least co-activated with all experts placed so far.
- `hypergraph`: minimises E[C_T] itself. Tokens are hyperedges over their k experts
  (identical expert sets merged into one weighted hyperedge); E[C_T] - 1 is the
  connectivity (km1) objective divided by T. Mt-KaHyPar partitions a seeded sample of the
  hyperedges with exact balance, then a swap refinement on *all* tokens lowers E[C_T]
  exactly, keeping E/D experts per device. Greedy and contiguous are candidates too and
  the best candidate wins, so the result is never worse than either.

Optional `max_load_ratio`: a bound on max/mean per-device load, the load of a device being
the token-expert assignments it computes (the sum of its experts' loads, `device_load_D` in
`occult.stats`). Greedy and hypergraph repair violations with the swaps that cost the least
E[C_T]; if the bound cannot be met (one expert alone exceeds it), the most balanced layout
found is kept and a warning says so.

The swap refinement evaluates every cross-device swap at once. With B the [U, E] incidence
of (merged) tokens, w their weights and N[u, d] the experts of token u on device d, the
change of sum_u w_u C_u when experts a (device p) and b (device q) trade places is

    gain0[a, q] - alone[a] + gain0[b, p] - alone[b] + both[a, b]

where gain0[a, q] = sum_{u ∋ a} w_u [N_uq = 0] (tokens that would newly touch q),
alone[a] = sum_{u ∋ a} w_u [N_u,dev(a) = 1] (tokens that would stop touching a's device),
and both[a, b] corrects tokens holding both a and b (whose device counts do not change):
both[a, b] = sum_u w_u ([a alone in u] + [b alone in u]) over tokens holding a and b. A
round computes all of these (one [E, U] x [U, D] matmul and bincounts over the pins), applies
the best swap, then the next best swaps of experts untouched this round, each kept only if
its exact change (recomputed on the tokens of the two experts) is still negative. Rounds
repeat until no swap lowers the cost: a swap-local optimum on all tokens.

Numerics: every sum is a bincount in float64, exact for integer token counts; no BLAS (its
spinning threads make small products 10-100x slower on shared, oversubscribed cores).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from occult.placement import Placement, check_divisible
from occult.stats import coactivation
from occult.trace import Trace

METHODS = ("contiguous", "greedy", "hypergraph")

# Mt-KaHyPar sees at most this many sampled tokens per layer: its run time grows with the
# number of hyperedges (about 7 s for 200k tokens of 64 experts on 2 cores, 0.3 s for 8k)
# while the partition it finds on a sample is as good once refined on all tokens.
DEFAULT_KAHYPAR_TOKENS = 8_000
# One Mt-KaHyPar thread: seeded single-threaded runs are reproducible, and on few cores
# more threads do not pay for themselves on hypergraphs this small.
DEFAULT_KAHYPAR_THREADS = 1
DEFAULT_MAX_ROUNDS = 200
MAX_REJECTS_PER_ROUND = 8  # stale candidates in a row before a round recomputes all gains


# ------------------------------------------------------------------ problem
def merge_token_sets(topk_ids_TK: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Merge tokens that picked the same expert set: (sets_UK sorted per row, count_U)."""
    ids = np.sort(np.asarray(topk_ids_TK), axis=1)
    if num_experts <= 64:
        # One uint64 bitmask per token: a 1-D unique is much faster than a row-wise one.
        bits = np.bitwise_or.reduce(np.left_shift(np.uint64(1), ids.astype(np.uint64)), axis=1)
        _, first, counts = np.unique(bits, return_index=True, return_counts=True)
        return ids[first].astype(np.int64), counts.astype(np.int64)
    sets, counts = np.unique(ids.astype(np.int64), axis=0, return_counts=True)
    return sets, counts.astype(np.int64)


class _SwapState:
    """Tokens of one layer (merged, weighted) and exact E[C_T] bookkeeping for moves and swaps.

    The refinement state is `N_UD`, the pins of token u on device d, updated in place by
    `apply_swap` / `apply_move` (which touch only the tokens of the experts they move). All
    sums are bincounts (exact in float64 for integer weights below 2^53): no BLAS, whose
    threads slow down badly on shared, oversubscribed cores.
    """

    def __init__(self, sets_UK: np.ndarray, weights_U: np.ndarray, num_experts: int, num_devices: int) -> None:
        self.E, self.D = num_experts, num_devices
        self.sets = np.ascontiguousarray(sets_UK, dtype=np.intp)
        self.w = np.asarray(weights_U, dtype=np.float64)
        self.total_weight = float(self.w.sum())
        U, K = self.sets.shape
        self.U, self.K = U, K
        self.pin_expert = self.sets.reshape(-1)  # [U*K] expert of every pin
        self.pin_token = np.repeat(np.arange(U), K)  # [U*K] token of every pin
        self.pin_w = self.w[self.pin_token]  # [U*K] weight of every pin
        self.load_E = np.bincount(self.pin_expert, weights=self.pin_w, minlength=num_experts)
        # Tokens of each expert (CSR): a swap only touches the tokens of its two experts.
        order = np.argsort(self.pin_expert, kind="stable")
        self.tok_ptr = np.concatenate([[0], np.cumsum(np.bincount(self.pin_expert, minlength=num_experts))])
        self.tok_idx = self.pin_token[order]
        # Expert-set bitmask of every token (64 experts per word), for "does u hold b" lookups.
        # A token's experts are distinct, so summing their bits is OR-ing them.
        words = (num_experts + 63) // 64
        word_UK = self.sets // 64
        bit_UK = np.left_shift(np.uint64(1), (self.sets % 64).astype(np.uint64))
        self.mask_UW = np.zeros((U, words), dtype=np.uint64)
        for i in range(words):
            self.mask_UW[:, i] = np.where(word_UK == i, bit_UK, np.uint64(0)).sum(axis=1, dtype=np.uint64)

    def tokens_of(self, e: int) -> np.ndarray:
        """Tokens (merged sets) that hold expert e."""
        return self.tok_idx[self.tok_ptr[e] : self.tok_ptr[e + 1]]

    def counts(self, dev_E: np.ndarray) -> np.ndarray:
        """[U, D] pins of each token on each device."""
        flat = self.pin_token * self.D + np.asarray(dev_E)[self.pin_expert]
        return np.bincount(flat, minlength=self.U * self.D).astype(np.int16).reshape(self.U, self.D)

    def cost_from_counts(self, N_UD: np.ndarray) -> float:
        """sum_u w_u C_u for the state `N_UD`."""
        return float(np.sum(self.w * np.count_nonzero(N_UD, axis=1)))

    def cost(self, dev_E: np.ndarray) -> float:
        """sum_u w_u C_u (divide by the total weight for E[C_T])."""
        return self.cost_from_counts(self.counts(dev_E))

    def mean_ct(self, dev_E: np.ndarray) -> float:
        return self.cost(dev_E) / self.total_weight if self.total_weight else 0.0

    def move_terms(self, dev_E: np.ndarray, N_UD: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gain0 [E, D], alone [E], alone_UK bool) as in the module docstring."""
        wz_UD = self.w[:, None] * (N_UD == 0)
        gain0 = np.empty((self.E, self.D))
        for d in range(self.D):
            gain0[:, d] = np.bincount(self.pin_expert, weights=wz_UD[self.pin_token, d], minlength=self.E)
        alone_UK = N_UD[self.pin_token, dev_E[self.pin_expert]].reshape(self.U, self.K) == 1
        alone = np.bincount(self.pin_expert, weights=self.pin_w * alone_UK.reshape(-1), minlength=self.E)
        return gain0, alone, alone_UK

    def swap_delta(self, dev_E: np.ndarray, N_UD: np.ndarray) -> np.ndarray:
        """[E, E] change of sum_u w_u C_u for swapping a and b (inf where on the same device)."""
        gain0, alone, alone_UK = self.move_terms(dev_E, N_UD)
        # both[a, b] = sum_u w_u [a alone on its device in u][b in u], enumerated per alone pin.
        u_idx, k_idx = np.nonzero(alone_UK)
        a = self.sets[u_idx, k_idx]
        flat = (a[:, None] * self.E + self.sets[u_idx]).reshape(-1)
        both = np.bincount(flat, weights=np.repeat(self.w[u_idx], self.K), minlength=self.E * self.E)
        both = both.reshape(self.E, self.E)
        both = both + both.T
        single = gain0[:, dev_E]  # single[a, b] = gain0[a, dev(b)]: a moves to b's device
        delta = single - alone[:, None] + single.T - alone[None, :] + both
        delta[dev_E[:, None] == dev_E[None, :]] = np.inf
        return delta

    def move_delta(self, dev_E: np.ndarray, N_UD: np.ndarray) -> np.ndarray:
        """[E, D] change of the cost for moving expert a to device q (0 for its own device)."""
        gain0, alone, _ = self.move_terms(dev_E, N_UD)
        delta = gain0 - alone[:, None]
        delta[np.arange(self.E), dev_E] = 0.0
        return delta

    def apply_swap(self, dev_E: np.ndarray, N_UD: np.ndarray, a: int, b: int) -> float:
        """Swap experts a and b in place; return the exact change of sum_u w_u C_u."""
        p, q = dev_E[a], dev_E[b]
        change = 0.0
        for x, src, dst, other in ((a, p, q, b), (b, q, p, a)):
            t = self.tokens_of(x)
            has_other = (self.mask_UW[t, other // 64] >> np.uint64(other % 64)) & np.uint64(1)
            only = t[has_other == 0]  # tokens holding both keep their counts
            n_src, n_dst = N_UD[only, src], N_UD[only, dst]
            change += float(np.sum(self.w[only] * ((n_dst == 0).astype(np.int8) - (n_src == 1))))
            N_UD[only, src] = n_src - 1
            N_UD[only, dst] = n_dst + 1
        dev_E[a], dev_E[b] = q, p
        return change

    def apply_move(self, dev_E: np.ndarray, N_UD: np.ndarray, a: int, q: int) -> None:
        ta = self.tokens_of(a)
        N_UD[ta, dev_E[a]] -= 1
        N_UD[ta, q] += 1
        dev_E[a] = q


def _device_load(dev_E: np.ndarray, load_E: np.ndarray, num_devices: int) -> np.ndarray:
    """[D] token-expert assignments each device computes."""
    return np.bincount(dev_E, weights=load_E, minlength=num_devices)


def _imbalance(dev_E: np.ndarray, load_E: np.ndarray, num_devices: int) -> float:
    load_D = _device_load(dev_E, load_E, num_devices)
    mean = load_D.mean()
    return float(load_D.max() / mean) if mean > 0 else 1.0


def _load_cap(load_E: np.ndarray, num_devices: int, max_load_ratio: float | None) -> float | None:
    if max_load_ratio is None:
        return None
    if not max_load_ratio >= 1.0:
        raise ValueError(f"max_load_ratio is max/mean device load and must be >= 1, got {max_load_ratio}")
    mean = float(load_E.sum()) / num_devices
    return max_load_ratio * mean * (1 + 1e-12)


def _swap_loads(dev_E: np.ndarray, load_E: np.ndarray, num_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """([E, E] the larger load of a's and b's devices after swapping a and b, [D] current loads)."""
    load_D = _device_load(dev_E, load_E, num_devices)
    lp = load_D[dev_E]
    dl = load_E[None, :] - load_E[:, None]  # a's device gains l_b - l_a, b's loses it
    return np.maximum(lp[:, None] + dl, lp[None, :] - dl), load_D


def rebalance_counts(state: _SwapState, dev_E: np.ndarray) -> np.ndarray:
    """Make every device hold exactly E/D experts, with the moves that raise the cost least."""
    dev = np.asarray(dev_E, dtype=np.intp).copy()
    per = state.E // state.D
    N = state.counts(dev)
    for _ in range(state.E):
        cnt = np.bincount(dev, minlength=state.D)
        over, under = cnt > per, cnt < per
        if not over.any():
            break
        delta = np.where(over[dev][:, None] & under[None, :], state.move_delta(dev, N), np.inf)
        a, q = np.unravel_index(np.argmin(delta), delta.shape)
        state.apply_move(dev, N, int(a), int(q))
    return dev


def refine_swaps(
    state: _SwapState,
    dev_E: np.ndarray,
    load_cap: float | None = None,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
) -> np.ndarray:
    """Pairwise swaps that strictly lower sum_u w_u C_u, keeping E/D experts per device.

    Each round computes every swap's exact change, applies the best one, then tries the next
    best swaps of experts not yet moved this round one by one, keeping each only if the exact
    cost still drops (and the load cap holds). Ends at a swap-local optimum. With
    `load_cap`, a start that violates the cap is first repaired (`_repair_load`); if the cap
    cannot be met, the most balanced layout found is returned unrefined.
    """
    dev = np.asarray(dev_E, dtype=np.intp).copy()
    if state.D == 1 or state.E == state.D or state.total_weight == 0:
        return dev
    N = state.counts(dev)
    if load_cap is not None:
        dev, N = _repair_load(state, dev, N, load_cap)
        if _device_load(dev, state.load_E, state.D).max() > load_cap:
            return dev
    iu = np.triu_indices(state.E, 1)
    for _ in range(max_rounds):
        delta = state.swap_delta(dev, N)
        if load_cap is not None:
            worst, _ = _swap_loads(dev, state.load_E, state.D)
            delta[worst > load_cap] = np.inf
        vals = delta[iu]
        good = np.flatnonzero(vals < -0.5)  # integer weights: a real improvement is >= 1
        if not len(good):
            break
        good = good[np.argsort(vals[good], kind="stable")]
        touched = np.zeros(state.E, dtype=bool)
        applied = rejected = 0
        for j in good[: 4 * state.E]:
            a, b = int(iu[0][j]), int(iu[1][j])
            if touched[a] or touched[b]:
                continue
            if rejected >= MAX_REJECTS_PER_ROUND:
                break
            if applied and load_cap is not None:
                load_D = _device_load(dev, state.load_E, state.D)
                d_l = state.load_E[b] - state.load_E[a]
                if max(load_D[dev[a]] + d_l, load_D[dev[b]] - d_l) > load_cap:
                    continue
            change = state.apply_swap(dev, N, a, b)
            if applied and not change < -0.5:
                state.apply_swap(dev, N, a, b)  # earlier swaps this round spoiled it: undo
                rejected += 1
                continue
            touched[a] = touched[b] = True
            applied += 1
    return dev


def _repair_load(
    state: _SwapState, dev: np.ndarray, N: np.ndarray, load_cap: float
) -> tuple[np.ndarray, np.ndarray]:
    """Swaps that lower the hottest device's load until `load_cap` holds, cheapest in E[C_T] first."""
    for _ in range(4 * state.E):  # each swap strictly cools the hottest device; bound the walk
        worst, load_D = _swap_loads(dev, state.load_E, state.D)
        if load_D.max() <= load_cap:
            break
        hot = int(np.argmax(load_D))
        delta = state.swap_delta(dev, N)
        # Swaps that strictly lower the hottest device without making another one as hot.
        ok = ((dev[:, None] == hot) | (dev[None, :] == hot)) & (worst < load_D[hot]) & np.isfinite(delta)
        if not ok.any():
            break
        fits = ok & (worst <= load_cap)
        if fits.any():
            cand = np.where(fits, delta, np.inf)
        else:  # the cap is out of reach in one swap: largest reduction first, then the cheapest
            scale = max(state.total_weight * state.K, 1.0)
            cand = np.where(ok, worst + 1e-3 * (delta / scale), np.inf)
        a, b = np.unravel_index(np.argmin(cand), cand.shape)
        state.apply_swap(dev, N, int(a), int(b))
    return dev, N


# ------------------------------------------------------------------ solvers
def contiguous_layer(num_experts: int, num_devices: int) -> np.ndarray:
    """[E] expert -> device of the contiguous layout."""
    return np.arange(num_experts) // check_divisible(num_experts, num_devices)


def greedy_layer(coact_EE: np.ndarray, num_devices: int) -> np.ndarray:
    """[E] expert -> device by the paper's greedy co-activation clustering (ties: lowest id)."""
    C = np.asarray(coact_EE, dtype=np.float64)
    E = C.shape[0]
    per = check_divisible(E, num_devices)
    load = np.diag(C).copy()
    C = C.copy()
    np.fill_diagonal(C, 0.0)
    dev = np.full(E, -1, dtype=np.intp)
    for d in range(num_devices):
        free = dev < 0
        if d == 0 and per >= 2:
            pair = np.where(free[:, None] & free[None, :] & ~np.eye(E, dtype=bool), C, -np.inf)
            a, b = np.unravel_index(np.argmax(pair), pair.shape)
            members = [int(a), int(b)]
        elif d == 0:
            members = [int(np.argmax(load))]
        else:
            placed = ~free
            score = np.where(free, C[:, placed].sum(1), np.inf)
            members = [int(np.argmin(score))]
        dev[members] = d
        while len(members) < per:
            free = dev < 0
            score = np.where(free, C[:, members].mean(1), -np.inf)
            e = int(np.argmax(score))
            members.append(e)
            dev[e] = d
    return dev


def best_method() -> str:
    """"hypergraph" when Mt-KaHyPar is importable, else "greedy" (e.g. on an image without it)."""
    import importlib.util

    return "hypergraph" if importlib.util.find_spec("mtkahypar") is not None else "greedy"


_KAHYPAR_LOCK = threading.Lock()
_KAHYPAR: dict[str, Any] = {}


def _kahypar(threads: int | None = None) -> Any:
    """The process-wide Mt-KaHyPar initializer (mtkahypar.initialize may run once per process,
    so the first caller's thread count holds for the process)."""
    with _KAHYPAR_LOCK:
        if "init" not in _KAHYPAR:
            try:
                import mtkahypar
            except ImportError as exc:  # pragma: no cover - it is a dependency
                raise ImportError(
                    "the hypergraph solver needs Mt-KaHyPar: pip install mtkahypar "
                    "(or use --method greedy)"
                ) from exc
            _KAHYPAR["module"] = mtkahypar
            _KAHYPAR["init"] = mtkahypar.initialize(int(threads or DEFAULT_KAHYPAR_THREADS), False)
        return _KAHYPAR["module"], _KAHYPAR["init"]


def kahypar_partition(
    sets_UK: np.ndarray,
    weights_U: np.ndarray,
    num_experts: int,
    num_devices: int,
    seed: int = 0,
    threads: int | None = None,
) -> np.ndarray:
    """[E] Mt-KaHyPar km1 (connectivity) partition of the experts into D blocks of exactly E/D.

    Uses the DEFAULT preset seeded with `seed`; with one thread (the default) the result is
    reproducible. The caller checks the balance (`rebalance_counts` repairs it if needed).
    """
    mtk, init = _kahypar(threads)
    with _KAHYPAR_LOCK:  # set_seed is global state of the library
        mtk.set_seed(int(seed))
        ctx = init.context_from_preset(mtk.PresetType.DEFAULT)
        ctx.set_partitioning_parameters(int(num_devices), 0.0, mtk.Objective.KM1)
        ctx.logging = False
        hg = init.create_hypergraph(
            ctx,
            int(num_experts),
            int(sets_UK.shape[0]),
            sets_UK.tolist(),
            [1] * int(num_experts),
            np.asarray(weights_U, dtype=np.int64).tolist(),
        )
        part = hg.partition(ctx)
        return np.asarray(part.get_partition(), dtype=np.intp)


@dataclass
class LayerResult:
    """Outcome of solving one layer: the expert -> device map and how it was chosen."""

    expert_device_E: np.ndarray
    method: str  # the candidate that won, e.g. "kahypar+refine"
    mean_ct: float
    candidates: dict[str, float] = field(default_factory=dict)  # candidate -> E[C_T]
    load_imbalance: float = 1.0  # max / mean device load of the result
    seconds: float = 0.0
    warning: str | None = None  # set when max_load_ratio could not be met


def _sample_tokens(topk_ids_TK: np.ndarray, max_tokens: int, rng: np.random.Generator) -> np.ndarray:
    T = topk_ids_TK.shape[0]
    if T <= max_tokens:
        return topk_ids_TK
    return topk_ids_TK[np.sort(rng.choice(T, size=max_tokens, replace=False))]


def solve_layer(
    topk_ids_TK: np.ndarray,
    num_experts: int,
    num_devices: int,
    method: str = "hypergraph",
    *,
    max_load_ratio: float | None = None,
    seed: int = 0,
    threads: int | None = None,
    kahypar_tokens: int = DEFAULT_KAHYPAR_TOKENS,
    coact_EE: np.ndarray | None = None,
) -> LayerResult:
    """Place one layer's experts on `num_devices` devices with `method` (module docstring).

    `max_load_ratio` bounds max/mean device load (a RuntimeWarning says when it cannot be
    met); `seed` makes Mt-KaHyPar and its token sample reproducible; `kahypar_tokens` caps
    the tokens Mt-KaHyPar sees (the refinement always uses all of them); `coact_EE` reuses
    a co-activation matrix already computed.
    """
    res = _solve_layer(
        topk_ids_TK, num_experts, num_devices, method, max_load_ratio, seed, threads, kahypar_tokens, coact_EE
    )
    if res.warning:
        warnings.warn(res.warning, RuntimeWarning, stacklevel=2)
    return res


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown placement method {method!r}; choose one of {', '.join(METHODS)}")


def _solve_layer(
    topk_ids_TK: np.ndarray,
    num_experts: int,
    num_devices: int,
    method: str,
    max_load_ratio: float | None,
    seed: int,
    threads: int | None,
    kahypar_tokens: int,
    coact_EE: np.ndarray | None,
) -> LayerResult:
    _check_method(method)
    t0 = time.perf_counter()
    ids = np.asarray(topk_ids_TK)
    if ids.ndim != 2 or ids.shape[0] == 0:
        raise ValueError(f"topk_ids must have shape [tokens >= 1, top_k], got {list(ids.shape)}")
    per = check_divisible(num_experts, num_devices)
    sets, weights = merge_token_sets(ids, num_experts)
    state = _SwapState(sets, weights, num_experts, num_devices)
    cap = _load_cap(state.load_E, num_devices, max_load_ratio)
    contiguous = contiguous_layer(num_experts, num_devices)
    candidates: dict[str, np.ndarray] = {}
    if method == "contiguous":
        candidates["contiguous"] = contiguous if cap is None else _repair_only(state, contiguous, cap)
    else:
        if coact_EE is None:
            coact_EE = coactivation(ids, num_experts)
        greedy = greedy_layer(coact_EE, num_devices)
        if method == "greedy":
            candidates["greedy"] = greedy if cap is None else _repair_only(state, greedy, cap)
        else:
            candidates["contiguous"] = contiguous if cap is None else _repair_only(state, contiguous, cap)
            candidates["greedy"] = greedy if cap is None else _repair_only(state, greedy, cap)
            candidates["greedy+refine"] = refine_swaps(state, greedy, cap)
            multi = sets[:, 0] != sets[:, -1]  # tokens on a single expert never cost anything
            if num_devices > 1 and per > 1 and multi.any():
                rng = np.random.default_rng(seed)
                sub_sets, sub_w = merge_token_sets(_sample_tokens(ids, kahypar_tokens, rng), num_experts)
                keep = sub_sets[:, 0] != sub_sets[:, -1]
                if keep.any():
                    part = kahypar_partition(sub_sets[keep], sub_w[keep], num_experts, num_devices, seed, threads)
                    if np.bincount(part, minlength=num_devices).max() != per:
                        part = rebalance_counts(state, part)
                    candidates["kahypar+refine"] = refine_swaps(state, part, cap)
    scored = {name: state.mean_ct(dev) for name, dev in candidates.items()}
    peak = {name: _device_load(dev, state.load_E, num_devices).max() for name, dev in candidates.items()}
    feasible = [n for n in candidates if cap is None or peak[n] <= cap]
    warning = None
    if feasible:
        best = min(feasible, key=lambda n: scored[n])  # ties: the earliest (simplest) candidate
    else:
        best = min(candidates, key=lambda n: (peak[n], scored[n]))
        warning = (
            f"no placement meets max_load_ratio={max_load_ratio}: the most balanced one found has "
            f"max/mean device load {_imbalance(candidates[best], state.load_E, num_devices):.3f} "
            "(an expert's own load may exceed the bound); raise the bound or drop it"
        )
    dev = candidates[best].astype(np.int64)
    return LayerResult(
        dev,
        best,
        scored[best],
        scored,
        _imbalance(dev, state.load_E, num_devices),
        time.perf_counter() - t0,
        warning,
    )


def _repair_only(state: _SwapState, dev_E: np.ndarray, cap: float) -> np.ndarray:
    """`dev_E` with its device loads brought under `cap` (cheapest swaps first), not refined further."""
    dev = np.asarray(dev_E, dtype=np.intp).copy()
    return _repair_load(state, dev, state.counts(dev), cap)[0]


@dataclass
class PlacementResult:
    """A multi-layer placement and the per-layer solver outcomes."""

    placement: Placement
    layers: list[LayerResult]
    method: str
    seconds: float
    jobs: int = 1


def available_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# Below this many tokens in all, worker start-up (an interpreter importing torch) costs more
# than solving layers in parallel saves.
PARALLEL_MIN_TOKENS = 400_000


def _auto_jobs(trace: Trace, method: str) -> int:
    if method == "contiguous" or trace.num_layers < 2 or sum(trace.num_tokens) < PARALLEL_MIN_TOKENS:
        return 1
    return min(available_cpus(), trace.num_layers)


def _pool(jobs: int) -> Any:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # forkserver: workers fork from a fresh server process, never from this one, whose
    # threads (Mt-KaHyPar's TBB pool, OpenMP) must not be inherited by a fork.
    methods = mp.get_all_start_methods()
    ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
    return ProcessPoolExecutor(max_workers=jobs, mp_context=ctx)


def place(
    trace: Trace,
    num_devices: int,
    method: str = "hypergraph",
    *,
    max_load_ratio: float | None = None,
    seed: int = 0,
    threads: int | None = None,
    kahypar_tokens: int = DEFAULT_KAHYPAR_TOKENS,
    progress: bool = False,
    coacts_LEE: Sequence[np.ndarray] | None = None,
    jobs: int | None = 1,
) -> PlacementResult:
    """Place every layer of `trace` on `num_devices` devices with `method` (layer i seeded seed + i).

    `jobs` worker processes solve layers in parallel (None: one per CPU when the trace is
    large enough to pay for starting them; `occult place` uses that); the result does not
    depend on it. `progress` shows a tqdm bar on stderr.
    """
    _check_method(method)
    check_divisible(trace.num_experts, num_devices)
    _load_cap(np.ones(1), 1, max_load_ratio)  # validate the bound before any work
    t0 = time.perf_counter()
    L = trace.num_layers
    jobs = _auto_jobs(trace, method) if jobs is None else max(1, min(int(jobs), L))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=L, desc=f"placing ({method})", unit="layer", file=sys.stderr, leave=False)

    def args(i: int) -> tuple[Any, ...]:
        coact = None if coacts_LEE is None else coacts_LEE[i]
        return (trace.layer(i), trace.num_experts, num_devices, method, max_load_ratio, seed + i, threads,
                kahypar_tokens, coact)

    results: list[LayerResult | None] = [None] * L
    try:
        if jobs == 1:
            for i in range(L):
                results[i] = _solve_layer(*args(i))
                if bar is not None:
                    bar.update(1)
        else:
            from concurrent.futures import as_completed

            with _pool(jobs) as pool:
                futures = {pool.submit(_solve_layer, *args(i)): i for i in range(L)}
                for fut in as_completed(futures):
                    results[futures[fut]] = fut.result()
                    if bar is not None:
                        bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    done = [r for r in results if r is not None]
    for i, r in enumerate(done):
        if r.warning:
            warnings.warn(f"layer {i}: {r.warning}", RuntimeWarning, stacklevel=2)
    placement = Placement(np.stack([r.expert_device_E for r in done]), num_devices)
    return PlacementResult(placement, done, method, time.perf_counter() - t0, jobs)
