"""Next-token selection on the device, with no host synchronisation, so that it runs inside the
captured decode graph of `generate` (`TokenSelector`, `filter_logits`, `sample`).

Sampling follows transformers' warpers in transformers' order, bit for bit on the same logits:
temperature (`scores / temperature`), then top-k (`TopKLogitsWarper`: every token scoring below
the k-th largest is dropped, ties at the k-th kept), then top-p (`TopPLogitsWarper`: sorted
ascending, a token is dropped when the cumulative probability up to and including it is
<= 1 - top_p; the most likely token is always kept). The draw differs from transformers'
`torch.multinomial`: it is the exponential race `argmax(probs / E)`, E ~ Exp(1) i.i.d. per
(row, token), which picks token i with probability probs[i] (the same distribution), is one
elementwise op and an argmax (capturable), and draws B x V numbers per step from the selector's
own generator, so a seed gives the same tokens in eager and replayed steps alike.

Differences from transformers' `GenerationConfig` semantics: nothing is read from the model's
generation config (transformers defaults top_k to 50 when sampling; here top_k=None is no top-k);
`top_k=0` and `top_p=1.0` also mean off, as there; min_p, typical_p, repetition penalties and
beams are not offered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy (`do_sample=False`) or sampled with these warpers."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if not self.do_sample:
            return
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 or None: off), got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 or None: off), got {self.top_p}")

    @property
    def key(self) -> tuple:
        """What a captured graph bakes in (greedy ignores the warpers)."""
        return (self.do_sample, self.temperature, self.top_k or None, self.top_p) if self.do_sample else (False,)


def filter_logits(
    scores_BV: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Temperature, then top-k, then top-p (transformers' warpers and order); dropped tokens get -inf."""
    if temperature != 1.0:
        scores_BV = scores_BV / temperature
    if top_k:
        k = min(top_k, scores_BV.shape[-1])
        kth_B1 = torch.topk(scores_BV, k, dim=-1).values[..., -1:]
        scores_BV = scores_BV.masked_fill(scores_BV < kth_B1, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_BV, order_BV = torch.sort(scores_BV, descending=False)
        drop_sorted_BV = sorted_BV.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        drop_sorted_BV[..., -1:].fill_(False)  # keep at least the most likely token (a kernel, no host copy)
        drop_BV = drop_sorted_BV.scatter(-1, order_BV, drop_sorted_BV)
        scores_BV = scores_BV.masked_fill(drop_BV, float("-inf"))
    return scores_BV


def sample(logits_BV: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids [B]: argmax when greedy, else the exponential race over the filtered softmax."""
    if not sampling.do_sample:
        return logits_BV.argmax(-1)
    scores_BV = filter_logits(logits_BV.float(), sampling.temperature, sampling.top_k, sampling.top_p)
    probs_BV = scores_BV.softmax(dim=-1)
    noise_BV = torch.empty_like(probs_BV).exponential_(generator=generator)
    return (probs_BV / noise_BV.clamp_min(torch.finfo(noise_BV.dtype).tiny)).argmax(-1)


class TokenSelector:
    """The token choice of one decode step for `batch` rows, device-only (capturable).

    Holds the generator of the draws (on `device`, re-seeded by `reset`), the eos ids and the
    per-row "unfinished" flags: a finished row gets `pad`, and a row finishes when it picks an
    eos id. `reset(rows, seed)` marks the first `rows` rows unfinished (the rest are padding
    rows, finished from the start) in place, so a graph that captured `__call__` stays valid.
    """

    def __init__(self, batch: int, device: torch.device, sampling: Sampling, eos: Sequence[int], pad: int) -> None:
        self.sampling, self.eos, self.pad = sampling, tuple(int(e) for e in eos), int(pad)
        self.unfinished_B = torch.zeros(batch, dtype=torch.bool, device=device)
        self.eos_E = torch.tensor(self.eos, dtype=torch.long, device=device)
        self.generator = torch.Generator(device=device) if sampling.do_sample else None

    @property
    def key(self) -> tuple:
        return (self.sampling.key, self.eos, self.pad)

    def reset(self, rows: int, seed: int | None = None) -> None:
        self.unfinished_B.copy_(torch.arange(self.unfinished_B.shape[0], device=self.unfinished_B.device) < rows)
        if self.generator is not None and seed is not None:
            self.generator.manual_seed(seed)

    def __call__(self, logits_BV: torch.Tensor) -> torch.Tensor:
        next_B = sample(logits_BV, self.sampling, self.generator)
        if self.eos:
            next_B = next_B.masked_fill(~self.unfinished_B, self.pad)
            self.unfinished_B &= ~(next_B[:, None] == self.eos_E).any(-1)  # not isin: it may sync for long lists
        return next_B
