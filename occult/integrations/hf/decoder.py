"""`StaticDecoder`: a converted (or plain) transformers model's decode step with a static KV cache,
fixed input buffers and the next-token choice on the device, replayed from one CUDA graph on
CUDA (`occult.integrations.hf.generate` drives it; see its module docstring for the protocol)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from occult.integrations.hf.families import UnsupportedModelError
from occult.integrations.hf.sampling import TokenSelector
from occult.moe.capture_stream import autocast_uncached
from occult.moe.status import ReplayedStatus
from occult.teardown import hold_collectives
from occult.training.signature import ModelSignature


def _check_attention(config: Any) -> None:
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager"):
        raise UnsupportedModelError(f"generate supports the 'sdpa' and 'eager' attention implementations, not {impl!r}")
    types = getattr(config, "layer_types", None) or []
    sliding = [t for t in types if t != "full_attention"]
    if sliding or (getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None)):
        raise UnsupportedModelError(
            f"generate supports full-attention layers only, not {sorted(set(sliding)) or 'sliding'}"
        )


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
        self.statuses = ReplayedStatus()  # the captured step's routing statuses (`capture`)
        self._signature = ModelSignature(model)  # what the model was at the capture (`needs_capture`)
        self._captured_for: tuple | None = None
        self.next_slot = 0  # host copy of slot_1: the cache slot the next step writes (no device read)
        self.eager_mask = getattr(model.config, "_attn_implementation", "eager") != "sdpa"

    # ---------------------------------------------------------------- state
    def _counters(self) -> list[torch.Tensor]:
        """The cache's in-place length counters (StaticLayer.cumulative_length)."""
        return [
            c for layer in self.cache.layers if isinstance(c := getattr(layer, "cumulative_length", None), torch.Tensor)
        ]

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
            raise ValueError(
                f"{what} would write cache slot {self.next_slot} of a StaticDecoder holding {self.max_len} "
                f"positions (prompt + new tokens); build the decoder with a larger max_len"
            )

    def _restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self._state(), saved):
            t.copy_(s)

    # -------------------------------------------------------------- prefill
    @torch.no_grad()
    def prefill(self, ids_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
        B, S = ids_BS.shape
        if B != self.batch_size or S >= self.max_len:
            raise ValueError(
                f"prefill of {tuple(ids_BS.shape)} into a decoder of batch {self.batch_size}, length {self.max_len}"
            )
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
        out = self.model(
            input_ids=ids_BS,
            attention_mask=attn,
            position_ids=pos_BS,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()

    # --------------------------------------------------------------- decode
    def _forward(self) -> torch.Tensor:
        """One decode forward from the buffers (capturable: device ops only, in-place updates)."""
        B = self.batch_size
        self.mask_BL.scatter_(1, self.slot_1.expand(B, 1), 1)
        keep_B11L = self.mask_BL[:, None, None, :].bool()
        if self.eager_mask:  # additive, as transformers' eager mask
            keep_B11L = torch.zeros((), dtype=self.dtype, device=self.device).masked_fill(
                ~keep_B11L, torch.finfo(self.dtype).min
            )
        out = self.model(
            input_ids=self.ids_B1,
            attention_mask=keep_B11L,
            position_ids=self.pos_B1,
            past_key_values=self.cache,
            use_cache=True,
        )
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
            self.statuses.replayed()
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
            # Triton compilation and allocator warm-up off the capture stream, in the capture's autocast state
            with torch.cuda.stream(side), autocast_uncached():
                self.warm_up(warmup, saved)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if self.selector is not None and self.selector.generator is not None:
                graph.register_generator_state(self.selector.generator)  # philox seed/offset read at each replay
            statuses = ReplayedStatus()  # what the layers report (dropped rows, bad routing), read after replays
            with autocast_uncached(), torch.cuda.graph(graph), statuses.capture():  # (autocast: capture_stream)
                self.logits_BV = self._forward()
            self.statuses = statuses
            self.graph = graph
            self._captured_for = self._signature()
            if torch.distributed.is_initialized():  # its collectives must go before the process group
                hold_collectives(self)
        finally:
            self._restore(saved)  # the capture advanced them; the K/V written at the next slot is re-written

    def needs_capture(self) -> bool:
        """Whether the decode step has no graph, or one the model no longer matches (a parameter or buffer replaced,
        a plain setting switched, a device transport's buffers grown: `occult.training.signature`), whose replay
        would read freed memory or take the old code path. Ask with the model as it decodes (its dispatch switched);
        an identity check while nothing changed."""
        return self.graph is None or self._signature() != self._captured_for

    def release(self) -> None:
        """Free the captured graph now (the next `generate` re-captures): a graph that holds NCCL
        collectives still alive at `dist.destroy_process_group()` hangs every rank there, so
        `occult.teardown` calls this before any process group is destroyed."""
        if self.graph is not None:
            torch.cuda.synchronize(self.device)
            self.graph.reset()
            self.graph = None

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
