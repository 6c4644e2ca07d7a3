"""(row, local expert) pair lists sorted by expert, built on the device without a host sync.

A pair is one valid entry `(r, k)` of `slots_RK`, named by its flat index `r * K + k`.
`build_pairs` returns

- `pair_P`: int32 `[R*K]`, flat indices grouped by expert (stable: ascending `r*K+k` within an
  expert), then the padding entries (slot -1 or out of range) at the end;
- `offsets_E1`: int32 `[E+1]`, expert `e`'s pairs are `pair_P[offsets[e]:offsets[e+1]]`;
  `offsets[E]` is the number of valid pairs `P`.

Nothing here reads a size back to the host: the GEMM kernels are persistent and walk a tile
list whose length they compute from `offsets_E1` on the device (`tile_schedule`,
`tile_lookup`); the host only bounds it by `R*K` (`max_tiles`) to size the grid. The row of
pair `i` is `i // K`, its gate `gates.view(-1)[i]`, so neither is materialised.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bucket(slots_ptr, offs, n, num_experts):
    """Expert of each flat entry; padding (-1) and out-of-range slots go to bucket E."""
    s = tl.load(slots_ptr + offs, mask=offs < n, other=-1)
    return tl.where((s >= 0) & (s < num_experts), s, num_experts).to(tl.int32)


@triton.jit
def _count_kernel(slots_ptr, counts_ptr, n, num_experts, num_blocks, BLOCK: tl.constexpr, B_POW2: tl.constexpr):
    blk = tl.program_id(0)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    key = _bucket(slots_ptr, offs, n, num_experts)
    hist = tl.histogram(key, B_POW2, mask=offs < n)
    bins = tl.arange(0, B_POW2)
    # bucket-major: counts[bucket * num_blocks + block], so a flat cumsum orders by (bucket, block)
    tl.store(counts_ptr + bins * num_blocks + blk, hist, mask=bins <= num_experts)


@triton.jit
def _place_kernel(
    slots_ptr,
    counts_ptr,
    cum_ptr,
    pair_ptr,
    offsets_ptr,
    n,
    num_experts,
    num_blocks,
    BLOCK: tl.constexpr,
    B_POW2: tl.constexpr,
):
    blk = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    offs = blk * BLOCK + i
    in_range = offs < n
    key = _bucket(slots_ptr, offs, n, num_experts)
    same = key[:, None] == key[None, :]
    before = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), axis=1)  # stable rank in block
    in_block = tl.sum((same & in_range[None, :]).to(tl.int32), axis=1)
    slot = key * num_blocks + blk
    pos = tl.load(cum_ptr + slot, mask=in_range, other=0) - in_block + before
    tl.store(pair_ptr + pos, offs, mask=in_range)
    if blk == 0:
        bins = tl.arange(0, B_POW2)
        ok = bins <= num_experts
        first = tl.load(cum_ptr + bins * num_blocks, mask=ok, other=0) - tl.load(
            counts_ptr + bins * num_blocks, mask=ok, other=0
        )
        tl.store(offsets_ptr + bins, first, mask=ok)


_PAIR_BLOCK = 128


def build_pairs(slots_RK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable counting sort of the flat (row, slot) entries by local expert (module docstring).

    Three launches (per-block bucket counts, one cumsum, placement), no host sync.
    """
    slots = slots_RK.reshape(-1)
    n = slots.numel()
    device = slots.device
    pair_P = torch.empty(n, device=device, dtype=torch.int32)
    offsets_E1 = torch.empty(num_experts + 1, device=device, dtype=torch.int32)
    if n == 0:
        offsets_E1.zero_()
        return pair_P, offsets_E1
    num_blocks = triton.cdiv(n, _PAIR_BLOCK)
    b_pow2 = max(16, triton.next_power_of_2(num_experts + 1))
    counts = torch.empty((num_experts + 1) * num_blocks, device=device, dtype=torch.int32)
    _count_kernel[(num_blocks,)](slots, counts, n, num_experts, num_blocks, BLOCK=_PAIR_BLOCK, B_POW2=b_pow2)
    cum = torch.cumsum(counts, 0, dtype=torch.int32)
    _place_kernel[(num_blocks,)](
        slots, counts, cum, pair_P, offsets_E1, n, num_experts, num_blocks, BLOCK=_PAIR_BLOCK, B_POW2=b_pow2
    )
    return pair_P, offsets_E1


def build_pairs_torch(slots_RK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same lists from torch ops (sort + searchsorted); a reference for tests."""
    key = slots_RK.reshape(-1).to(torch.int32)
    key = torch.where(key < 0, num_experts, key).clamp_(max=num_experts)
    sorted_key, order = torch.sort(key, stable=True)
    bounds = torch.arange(num_experts + 1, device=key.device, dtype=torch.int32)
    offsets_E1 = torch.searchsorted(sorted_key, bounds, out_int32=True)
    return order.to(torch.int32), offsets_E1


def max_tiles(num_pairs_bound: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the m-tiles of all experts: each expert adds at most one partial tile."""
    return triton.cdiv(num_pairs_bound, block_m) + min(num_experts, num_pairs_bound)


@triton.jit
def tile_schedule(offsets_ptr, num_experts, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """Per-expert tile counts in registers, from the `E+1` offsets (one schedule for any BLOCK_M).

    Tiles are laid out expert after expert, `cdiv(count_e, BLOCK_M)` each; the total is
    `sum(ntiles)`, known only on the device. Returns vectors over `E_POW2` lanes.
    """
    e = tl.arange(0, E_POW2)
    in_range = e < num_experts
    lo = tl.load(offsets_ptr + e, mask=in_range, other=0)
    hi = tl.load(offsets_ptr + e + 1, mask=in_range, other=0)
    ntiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(ntiles, axis=0)  # inclusive
    return e, lo, hi, ntiles, cum


@triton.jit
def tile_lookup(e, lo, hi, ntiles, cum, tile_m, BLOCK_M: tl.constexpr):
    """(expert, first pair position, end of the expert's pairs) of m-tile `tile_m`."""
    expert = tl.sum((cum <= tile_m).to(tl.int32), axis=0)
    before = tl.sum(tl.where(e < expert, ntiles, 0), axis=0)
    sel = e == expert
    start = tl.sum(tl.where(sel, lo, 0), axis=0) + (tile_m - before) * BLOCK_M
    end = tl.sum(tl.where(sel, hi, 0), axis=0)
    return expert, start, end


@triton.jit
def grouped_pid(pid, num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr):
    """Swizzle a flat program id into (m-tile, n-tile): GROUP_M m-tiles sweep the n-tiles together."""
    width = GROUP_M * num_tiles_n
    group = pid // width
    first_m = group * GROUP_M
    group_size = tl.minimum(num_tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % width) % group_size
    tile_n = (pid % width) // group_size
    return tile_m, tile_n


def e_pow2(num_experts: int) -> int:
    return max(16, triton.next_power_of_2(num_experts))
