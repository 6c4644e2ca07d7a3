"""Swap refinement: exact E[C_T] bookkeeping of one layer and the local search that lowers it.

Tokens that picked the same expert set are merged into one weighted token
(`merge_token_sets`); `SwapState` keeps, for a layer's expert -> device map, how many of each
token's experts sit on each device. `refine_swaps` then trades experts between devices while
the exact cost drops, keeping E/D experts per device; `rebalance_counts` repairs a partition
whose device sizes are off, and `repair_load` / `repair_load_only` bring device loads under a
`max_load_ratio` bound with the swaps that cost the least E[C_T].

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
spinning threads make small products much slower on shared, oversubscribed cores: docs/history.md,
"Placement solver on CPU").
"""

from __future__ import annotations

import numpy as np

DEFAULT_MAX_ROUNDS = 200
MAX_REJECTS_PER_ROUND = 8  # stale candidates in a row before a round recomputes all gains


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


class SwapState:
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


def device_load(dev_E: np.ndarray, load_E: np.ndarray, num_devices: int) -> np.ndarray:
    """[D] token-expert assignments each device computes."""
    return np.bincount(dev_E, weights=load_E, minlength=num_devices)


def load_imbalance(dev_E: np.ndarray, load_E: np.ndarray, num_devices: int) -> float:
    """max / mean device load of the map `dev_E` (1.0 when nothing is loaded)."""
    load_D = device_load(dev_E, load_E, num_devices)
    mean = load_D.mean()
    return float(load_D.max() / mean) if mean > 0 else 1.0


def device_load_cap(load_E: np.ndarray, num_devices: int, max_load_ratio: float | None) -> float | None:
    """The largest device load `max_load_ratio` allows (None: no bound); a ratio below 1 is an error."""
    if max_load_ratio is None:
        return None
    if not max_load_ratio >= 1.0:
        raise ValueError(f"max_load_ratio is max/mean device load and must be >= 1, got {max_load_ratio}")
    mean = float(load_E.sum()) / num_devices
    return max_load_ratio * mean * (1 + 1e-12)


def _swap_loads(dev_E: np.ndarray, load_E: np.ndarray, num_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """([E, E] the larger load of a's and b's devices after swapping a and b, [D] current loads)."""
    load_D = device_load(dev_E, load_E, num_devices)
    lp = load_D[dev_E]
    dl = load_E[None, :] - load_E[:, None]  # a's device gains l_b - l_a, b's loses it
    return np.maximum(lp[:, None] + dl, lp[None, :] - dl), load_D


def rebalance_counts(state: SwapState, dev_E: np.ndarray) -> np.ndarray:
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
    state: SwapState,
    dev_E: np.ndarray,
    load_cap: float | None = None,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
    group_E: np.ndarray | None = None,
) -> np.ndarray:
    """Pairwise swaps that strictly lower sum_u w_u C_u, keeping E/D experts per device.

    Each round computes every swap's exact change, applies the best one, then tries the next
    best swaps of experts not yet moved this round one by one, keeping each only if the exact
    cost still drops (and the load cap holds). Ends at a swap-local optimum. With
    `load_cap`, a start that violates the cap is first repaired (`repair_load`); if the cap
    cannot be met, the most balanced layout found is returned unrefined. With `group_E` (e.g.
    each expert's node), only experts of the same group trade places: groups keep their experts.
    """
    dev = np.asarray(dev_E, dtype=np.intp).copy()
    if state.D == 1 or state.E == state.D or state.total_weight == 0:
        return dev
    N = state.counts(dev)
    if load_cap is not None:
        dev, N = repair_load(state, dev, N, load_cap, group_E)
        if device_load(dev, state.load_E, state.D).max() > load_cap:
            return dev
    iu = np.triu_indices(state.E, 1)
    for _ in range(max_rounds):
        delta = state.swap_delta(dev, N)
        if group_E is not None:
            delta[group_E[:, None] != group_E[None, :]] = np.inf
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
                load_D = device_load(dev, state.load_E, state.D)
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


def repair_load(
    state: SwapState, dev: np.ndarray, N: np.ndarray, load_cap: float, group_E: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Swaps that lower the hottest device's load until `load_cap` holds, cheapest in E[C_T] first."""
    for _ in range(4 * state.E):  # each swap strictly cools the hottest device; bound the walk
        worst, load_D = _swap_loads(dev, state.load_E, state.D)
        if load_D.max() <= load_cap:
            break
        hot = int(np.argmax(load_D))
        delta = state.swap_delta(dev, N)
        if group_E is not None:
            delta[group_E[:, None] != group_E[None, :]] = np.inf
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


def repair_load_only(state: SwapState, dev_E: np.ndarray, cap: float) -> np.ndarray:
    """`dev_E` with its device loads brought under `cap` (cheapest swaps first), not refined further."""
    dev = np.asarray(dev_E, dtype=np.intp).copy()
    return repair_load(state, dev, state.counts(dev), cap)[0]
