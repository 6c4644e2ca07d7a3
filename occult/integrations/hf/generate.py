"""Generation with a static KV cache on every rank of a converted model's group (`generate`), the
decode step sync-free and, on CUDA, captured once in a CUDA graph (`StaticDecoder`).

Every MoE layer of a converted model is a collective, so all ranks must run the same number of
forwards with, for sync-free dispatch, the same token count. `generate`:

1. agrees once with the other ranks (one all-reduce of 4 integers) on the largest batch, the
   largest prompt length and `max_new_tokens` (which must be equal on every rank);
2. pads its batch to the largest one with dummy rows (one pad token, attended, so every row
   stays finite) and sizes a transformers `StaticCache` to largest prompt + `max_new_tokens` on
   every rank (or reuses the decoder kept from an earlier call if its cache is at least that long); its own prompts are not re-padded (each rank keeps its own prompt length);
3. prefills eagerly with normal dispatch (one host synchronisation per MoE layer);
4. decodes with `set_sync_free(model, True)`: every step is one forward of [B, 1] tokens with
   static shapes (input ids, position ids, cache slot and the 2-D attention mask live in fixed
   buffers; the StaticCache's K/V tensors and length counters are updated in place), replayed
   from a `torch.cuda.CUDAGraph` on CUDA (`cuda_graph` True or "auto"), run eagerly on CPU; the
   next token is chosen inside that step (`sampling.TokenSelector`: argmax, or temperature /
   top-k / top-p sampling from the decoder's own seeded generator, and the eos bookkeeping) and
   fed to the next one on the device, so a step is one graph replay and no host work;
5. keeps stepping (finished rows fed the pad token, as transformers does) until every rank is
   done: if any rank has eos tokens, one tiny all-reduce every `sync_every` steps (the largest
   over ranks) decides; else exactly `max_new_tokens` steps. No rank waits on one that stopped.

Greedy, the result on each rank is what `model.generate(input_ids, do_sample=False, ...)` of the
unconverted model returns for that rank's prompts alone (sampled: the same warpers, another draw): prompt + new tokens, pad after eos,
trimmed to the step at which this rank's own rows were all finished. Supported attention
implementations: "sdpa" and "eager" (the decode step passes its own 4-D mask); no sliding-window
layers. The previous sync_free setting of every MoE layer is restored afterwards.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from occult.integrations.hf.families import UnsupportedModelError, _group_size
from occult.integrations.hf.sampling import Sampling, TokenSelector
from occult.moe.layer import OccultMoE, set_sync_free


def model_group(model: nn.Module) -> Any:
    """The process group of the model's expert-parallel layers (None: unconverted, or the default group)."""
    for m in model.modules():
        if isinstance(m, OccultMoE):
            return m.dispatcher.group
    return None


def _check_attention(config: Any) -> None:
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager"):
        raise UnsupportedModelError(f"generate supports the 'sdpa' and 'eager' attention implementations, not {impl!r}")
    types = getattr(config, "layer_types", None) or []
    sliding = [t for t in types if t != "full_attention"]
    if sliding or (getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None)):
        raise UnsupportedModelError(f"generate supports full-attention layers only, not {sorted(set(sliding)) or 'sliding'}")


class StaticDecoder:
    """A StaticCache and fixed decode buffers for `batch_size` rows and `max_len` positions.

    `prefill(ids [B, S], mask [B, S])` fills the cache and returns the last position's logits
    [B, V] (float32); `step(ids [B])` feeds one token per row and returns the next logits [B, V]
    (a static buffer when graph-captured: read or copy it before the next step). `capture()`
    records the step in a CUDA graph (warm-up on a side stream; every buffer and the cache's
    counters restored afterwards, so capturing changes nothing). Reusable: `prefill` resets it.
    The caller chooses the dispatch mode (`set_sync_free`) around each call.

    With a `selector` (`TokenSelector`), every step also chooses the next tokens on the device,
    inside the captured graph: `select(logits [B, V])` chooses them from the prefill's logits
    (eagerly), then each `step()` (no ids) feeds the last choice and leaves the new one in
    `next_B` (a static buffer when graph-captured).

    The cache holds `max_len` positions: a prefill of S tokens leaves room for `max_len - S`
    steps. The host counts the steps (`free_slots`), so one more raises a ValueError before
    anything is launched instead of writing past the cache (on CUDA a device-side assert that
    breaks the process's CUDA context). `capture()` needs one free slot: its warm-up forwards
    all write at the next slot (the state restored after each), never past it.
    """

    def __init__(self, model: nn.Module, batch_size: int, max_len: int, selector: TokenSelector | None = None) -> None:
        from transformers import StaticCache

        _check_attention(model.config)
        self.model, self.batch_size, self.max_len = model, batch_size, max_len
        self.device = next(model.parameters()).device
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        kw = dict(dtype=torch.long, device=self.device)
        self.mask_BL = torch.zeros(batch_size, max_len, **kw)  # keys attended (prompt mask, then each new slot)
        self.pos_B1 = torch.zeros(batch_size, 1, **kw)  # position id of the next token
        self.slot_1 = torch.zeros(1, **kw)  # cache slot of the next token (the same for every row)
        self.ids_B1 = torch.zeros(batch_size, 1, **kw)
        self.logits_BV: torch.Tensor | None = None
        self.selector, self.next_B = selector, torch.zeros(batch_size, **kw)
        self.graph: Any = None
        self.next_slot = 0  # host copy of slot_1: the cache slot the next step writes (no device read)
        self.eager_mask = getattr(model.config, "_attn_implementation", "eager") != "sdpa"

    # ---------------------------------------------------------------- state
    def _counters(self) -> list[torch.Tensor]:
        """The cache's in-place length counters (StaticLayer.cumulative_length)."""
        return [c for layer in self.cache.layers if isinstance(c := getattr(layer, "cumulative_length", None), torch.Tensor)]

    def _state(self) -> list[torch.Tensor]:
        extra = [self.next_B, self.selector.unfinished_B] if self.selector is not None else []
        return [self.mask_BL, self.pos_B1, self.slot_1, self.ids_B1, *extra, *self._counters()]

    @property
    def free_slots(self) -> int:
        """Decode steps the cache has room for from here (0 before the first prefill)."""
        return self.max_len - self.next_slot if self.next_slot > 0 else 0

    def _check_room(self, what: str) -> None:
        if self.next_slot == 0:
            raise ValueError(f"{what} before prefill: call prefill(ids, mask) first")
        if self.next_slot >= self.max_len:
            raise ValueError(f"{what} would write cache slot {self.next_slot} of a StaticDecoder holding {self.max_len} "
                             f"positions (prompt + new tokens); build the decoder with a larger max_len")

    def _restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self._state(), saved):
            t.copy_(s)

    # -------------------------------------------------------------- prefill
    @torch.no_grad()
    def prefill(self, ids_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
        B, S = ids_BS.shape
        if B != self.batch_size or S >= self.max_len:
            raise ValueError(f"prefill of {tuple(ids_BS.shape)} into a decoder of batch {self.batch_size}, "
                             f"length {self.max_len}")
        if self.cache.is_initialized:
            self.cache.reset()  # zeroes K/V and the counters in place: captured addresses stay valid
        mask_BS = mask_BS.to(device=self.device, dtype=torch.long)
        pos_BS = (mask_BS.cumsum(-1) - 1).masked_fill(mask_BS == 0, 0)  # as transformers' generate
        self.mask_BL.zero_()
        self.mask_BL[:, :S].copy_(mask_BS)
        self.pos_B1.copy_(pos_BS[:, -1:] + 1)
        self.slot_1.fill_(S)
        self.next_slot = S
        attn = None if bool(mask_BS.all()) else mask_BS  # transformers drops an all-ones mask too
        out = self.model(input_ids=ids_BS, attention_mask=attn, position_ids=pos_BS, past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    # --------------------------------------------------------------- decode
    def _forward(self) -> torch.Tensor:
        """One decode forward from the buffers (capturable: device ops only, in-place updates)."""
        B = self.batch_size
        self.mask_BL.scatter_(1, self.slot_1.expand(B, 1), 1)
        keep_B11L = self.mask_BL[:, None, None, :].bool()
        if self.eager_mask:  # additive, as transformers' eager mask
            keep_B11L = torch.zeros((), dtype=self.dtype, device=self.device).masked_fill(
                ~keep_B11L, torch.finfo(self.dtype).min)
        out = self.model(input_ids=self.ids_B1, attention_mask=keep_B11L, position_ids=self.pos_B1,
                         past_key_values=self.cache, use_cache=True)
        self.pos_B1.add_(1)
        self.slot_1.add_(1)
        logits_BV = out.logits[:, -1].float()
        if self.selector is not None:
            self._choose(logits_BV)
        return logits_BV

    def _choose(self, logits_BV: torch.Tensor) -> None:
        next_B = self.selector(logits_BV)
        self.next_B.copy_(next_B)
        self.ids_B1.copy_(next_B[:, None])

    @torch.no_grad()
    def select(self, logits_BV: torch.Tensor) -> torch.Tensor:
        """Choose the next tokens [B] from these logits with the selector; the next `step()` feeds them."""
        if self.selector is None:
            raise ValueError("this StaticDecoder has no selector")
        self._choose(logits_BV)
        return self.next_B

    @torch.no_grad()
    def step(self, ids_B: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step on `ids_B` (None: the selector's last choice); returns the logits [B, V]."""
        if ids_B is not None:
            self.ids_B1.copy_(ids_B.reshape(self.batch_size, 1))
        elif self.selector is None:
            raise ValueError("step() without ids needs a selector")
        self._check_room("step()")
        self.next_slot += 1
        if self.graph is not None:
            self.graph.replay()
            return self.logits_BV
        return self._forward()

    @torch.no_grad()
    def capture(self, warmup: int = 2) -> None:
        """Record the decode step in a CUDA graph; the buffers and the cache are left as they were.

        Needs one free cache slot (after `prefill`): the warm-up forwards run from the same state
        (restored after each), so they write the next slot only; the step's first replay re-writes it.
        """
        self._check_room("capture()")
        saved = [t.clone() for t in self._state()]
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # Triton compilation and allocator warm-up off the capture stream
                self.warm_up(warmup, saved)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if self.selector is not None and self.selector.generator is not None:
                graph.register_generator_state(self.selector.generator)  # philox seed/offset read at each replay
            with torch.cuda.graph(graph):
                self.logits_BV = self._forward()
            self.graph = graph
        finally:
            self._restore(saved)  # the capture advanced them; the K/V written at the next slot is re-written

    @torch.no_grad()
    def warm_up(self, steps: int, saved: list[torch.Tensor] | None = None) -> None:
        """Run `steps` decode forwards, each from the current state, then restore it: nothing advances.

        Each forward writes the next cache slot only (so `steps` may exceed `free_slots`), which
        the next real step re-writes. `saved`: the state as `[t.clone() for t in _state()]`.
        """
        self._check_room("warm_up()")
        saved = [t.clone() for t in self._state()] if saved is None else saved
        try:
            for _ in range(steps):
                self._forward()
                self._restore(saved)
        finally:
            self._restore(saved)


# ------------------------------------------------------------------ helpers
def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value.tolist() if torch.is_tensor(value) else value if isinstance(value, Sequence) else [value])]


def _agree(values: list[int], group: Any, world: int, device: torch.device) -> list[int]:
    """Element-wise max over the group's ranks (one all-reduce)."""
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _all_done(done: torch.Tensor, group: Any, world: int) -> bool:
    flag = done.to(torch.int32).reshape(1)
    if world > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _decoder(model: nn.Module, batch: int, max_len: int, graph: bool, reuse: bool,
             selector: TokenSelector) -> StaticDecoder:
    """A StaticDecoder of this batch and token choice holding at least `max_len` positions: the model's kept
    one if it fits (its graph too, so calls of another length re-capture nothing), else a new one
    (kept, replacing the old, with `reuse`; without it the kept one is left as it is)."""
    key = (batch, graph, selector.key)
    kept = getattr(model, "_occult_decoder", None) if reuse else None
    if kept is not None and kept[0] == key and kept[1].max_len >= max_len:
        return kept[1]
    if reuse and hasattr(model, "_occult_decoder"):
        del model._occult_decoder  # free the old cache and graph first
    dec = StaticDecoder(model, batch, max_len, selector)
    if reuse:
        model._occult_decoder = (key, dec)
    return dec


# ------------------------------------------------------------------ generate
@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    cuda_graph: bool | str = "auto",
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    sync_every: int = 8,
    reuse: bool = True,
    group: Any = None,
) -> torch.Tensor:
    """Greedy (or sampled) generation on every rank of the model's group: [B, S] -> [B, S + n].

    Call on every rank with its own prompts (any batch size, even 0, and prompt length) and the
    same `max_new_tokens`. `attention_mask` [B, S] marks real tokens (left padding); without it,
    as in transformers, pad tokens are masked when the pad id is set and differs from eos.
    `eos_token_id` / `pad_token_id` default to the model's generation config (pad falls back to
    the first eos, then 0). `do_sample=True` samples with `temperature`, then `top_k`, then
    `top_p` (transformers' warpers; `occult.integrations.hf.sampling` says what differs), inside
    the captured decode step: the draws come from a generator of the decoder on the model's
    device, seeded with `seed`, else with one number drawn from `generator` (any device), else
    from torch's global RNG (so `torch.manual_seed` makes a call repeatable). The tokens of a
    seed depend on the padded batch (the largest over the group), as the draws are [B, V].
    `cuda_graph`: "auto" captures the decode step on CUDA (eager if the capture fails on any
    rank), True requires it, False runs eagerly. `reuse=True` keeps the decoder (cache, buffers,
    graph) on the model for the next call of the same padded batch and token choice whose prompt +
    new tokens fit its cache (as transformers reuses a large enough static cache; the keys past
    this call's length are masked); `del model._occult_decoder` frees it.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")
    sampling = Sampling(do_sample, temperature, top_k, top_p)  # checks the values
    group = model_group(model) if group is None else group
    world, _ = _group_size(group)
    device = next(model.parameters()).device
    gen_cfg = getattr(model, "generation_config", None)
    eos = _token_ids(eos_token_id if eos_token_id is not None else getattr(gen_cfg, "eos_token_id", None))
    if pad_token_id is None:
        pad_token_id = getattr(gen_cfg, "pad_token_id", None)
    ids_BS = input_ids.to(device)
    B, S = ids_BS.shape
    if attention_mask is None:
        infer = pad_token_id is not None and pad_token_id not in eos and bool((ids_BS == pad_token_id).any())
        attention_mask = (ids_BS != pad_token_id) if infer else torch.ones_like(ids_BS)
    mask_BS = attention_mask.to(device=device, dtype=torch.long)
    if mask_BS.shape != ids_BS.shape:
        raise ValueError(f"attention_mask {tuple(mask_BS.shape)} does not match input_ids {tuple(ids_BS.shape)}")
    pad = int(pad_token_id if pad_token_id is not None else (eos[0] if eos else 0))

    # one all-reduce: the batch every rank pads to, the cache length, max_new_tokens equal everywhere, and
    # when to ask whether all are done (every `every` steps, if any rank has an eos token)
    B_max, S_max, n_max, neg_n_min, every, any_eos = _agree(
        [B, S, max_new_tokens, -max_new_tokens, sync_every, int(bool(eos))], group, world, device)
    if n_max != -neg_n_min:
        raise ValueError(f"max_new_tokens differs between ranks ({-neg_n_min} to {n_max}); pass the same value on every rank")
    if B_max == 0:
        return ids_BS
    if B > 0 and S == 0:
        raise ValueError("prompts must hold at least one token")
    S_own = max(S, 1)  # a rank with no prompts ([0, S]) steps with dummy rows of one token
    ids_PS = torch.cat([ids_BS[:, :S_own], ids_BS.new_full((B_max - B, S_own), pad)])  # dummy rows: one attended pad
    mask_PS = torch.cat([mask_BS[:, :S_own], mask_BS.new_zeros((B_max - B, S_own))])
    mask_PS[B:, -1] = 1
    use_graph = device.type == "cuda" and cuda_graph in (True, "auto")
    if cuda_graph is True and device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs a CUDA model, this one is on {device.type}")

    if do_sample and seed is None:
        seed = int(torch.randint(2**62, (1,), generator=generator,
                                 device=generator.device if generator is not None else "cpu"))
    previous = [(m, m.sync_free) for m in model.modules() if isinstance(m, OccultMoE)]
    try:
        dec = _decoder(model, B_max, S_max + max_new_tokens, use_graph, reuse,
                       TokenSelector(B_max, device, sampling, eos, pad))
        set_sync_free(model, False)  # prefill: ranks' token counts may differ, normal dispatch
        logits_PV = dec.prefill(ids_PS, mask_PS)
        set_sync_free(model, True)
        if use_graph and dec.graph is None and max_new_tokens > 1:  # one new token: no decode step to capture
            error = None
            try:
                dec.capture()
            except Exception as exc:  # noqa: BLE001 (every rank learns of it below)
                error = exc
            if _agree([int(error is not None)], group, world, device)[0]:
                if cuda_graph is True:
                    raise RuntimeError(f"CUDA-graph capture of the decode step failed on a rank: {error!r}") from error
                dec.graph = None
        dec.selector.reset(B, seed)  # after the capture: its warm-up draws do not count
        unfinished_P = dec.selector.unfinished_B
        new = [dec.select(logits_PV).clone()]  # token 1 from the prefill; each step feeds and chooses the next
        for t in range(1, max_new_tokens):
            if any_eos and t % every == 0 and _all_done(~unfinished_P.any(), group, world):
                break
            dec.step()
            new.append(dec.next_B.clone())
    finally:
        for m, flag in previous:
            m.sync_free = flag
    new_BN = torch.stack(new, dim=1)[:B]
    n = new_BN.shape[1]
    if eos and B > 0:  # this rank alone would have stopped once all its rows had finished
        hit_BN = torch.isin(new_BN, dec.selector.eos_E)
        first_B = torch.where(hit_BN.any(1), hit_BN.int().argmax(1) + 1, n)
        n = int(first_B.max())
    return torch.cat([ids_BS, new_BN[:, :n]], dim=1)
