"""Generation with a static KV cache on every rank of a converted model's group (`generate`), the
decode step with no host wait (sync-free, or over the device transport) and, on CUDA, captured once
in a CUDA graph (`StaticDecoder`).

Every MoE layer of a converted model is a collective, so all ranks must run the same number of
forwards with, for sync-free dispatch, the same token count. `generate`:

1. agrees once with the other ranks (one all-reduce of 4 integers) on the largest batch, the
   largest prompt length and `max_new_tokens` (which must be equal on every rank);
2. pads its batch to the largest one with dummy rows (one pad token, attended, so every row
   stays finite) and sizes a transformers `StaticCache` to largest prompt + `max_new_tokens` on
   every rank (or reuses the decoder kept from an earlier call if its cache is at least that
   long and the model is what it was then); its own prompts are not re-padded (each rank keeps its own prompt
   length);
3. prefills eagerly with normal dispatch (one host synchronisation per MoE layer);
4. decodes with no host wait: layers over the device transport (`transport="device"`: exact, only
   real rows sent) as they are, the others switched to sync-free dispatch (`_decode_dispatch`);
   every step is one forward of [B, 1] tokens with
   static shapes (input ids, position ids, cache slot and the 2-D attention mask live in fixed
   buffers; the StaticCache's K/V tensors and length counters are updated in place), replayed
   from a `torch.cuda.CUDAGraph` on CUDA (`cuda_graph` True or "auto"), run eagerly on CPU; the
   next token is chosen inside that step (`sampling.TokenSelector`: argmax, or temperature /
   top-k / top-p sampling from the decoder's own seeded generator, and the eos bookkeeping) and
   fed to the next one on the device, so a step is one graph replay and no host work; a kept graph is
   captured again on every rank where the model changed since on any (`StaticDecoder.needs_capture`: a replaced
   weight, a switched setting, a device transport's buffers grown by this call's prefill);
5. keeps stepping (finished rows fed the pad token, as transformers does) until every rank is
   done: if any rank has eos tokens, one tiny all-reduce every `sync_every` steps (the largest
   over ranks) decides; else exactly `max_new_tokens` steps. No rank waits on one that stopped.

Greedy, the result on each rank is what `model.generate(input_ids, do_sample=False, ...)` of the
unconverted model returns for that rank's prompts alone (sampled: the same warpers, another
draw): prompt + new tokens, pad after eos, trimmed to the step at which this rank's own rows
were all finished. Supported attention
implementations: "sdpa" and "eager" (the decode step passes its own 4-D mask); no sliding-window
layers. The previous sync_free setting of every MoE layer is restored afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from occult.integrations.hf.decoder import StaticDecoder
from occult.integrations.hf.families import group_size
from occult.integrations.hf.sampling import Sampling, TokenSelector
from occult.moe.layer import OccultMoE
from occult.moe.model_layers import set_sync_free, uncapturable_layers
from occult.training.signature import ModelSignature


def model_group(model: nn.Module) -> Any:
    """The process group of the model's expert-parallel layers (None: unconverted, or the default group)."""
    for m in model.modules():
        if isinstance(m, OccultMoE):
            return m.dispatcher.group
    return None


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [
        int(v)
        for v in (value.tolist() if torch.is_tensor(value) else value if isinstance(value, Sequence) else [value])
    ]


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


class KeptDecoder(NamedTuple):
    """A decoder kept on the model for the next `generate` call (`model._occult_decoder`), and what the model was
    when it was built (`signature`, an `occult.training.signature.ModelSignature`, gave `built_for`)."""

    key: tuple
    decoder: StaticDecoder
    signature: ModelSignature
    built_for: tuple


def _decoder(
    model: nn.Module, batch: int, max_len: int, graph: bool, reuse: bool, selector: TokenSelector
) -> StaticDecoder:
    """A StaticDecoder of this batch and token choice holding at least `max_len` positions: the model's kept
    one if it fits (its graph too, so calls of another length re-capture nothing) and the model is what it was
    when that one was built (a parameter replaced, a dtype changed: its cache and graph would not fit), else a new
    one (kept, replacing the old, with `reuse`; without it the kept one is left as it is)."""
    key = (batch, graph, selector.key)
    kept = getattr(model, "_occult_decoder", None) if reuse else None
    if kept is not None and kept.key == key and kept.decoder.max_len >= max_len and kept.signature() == kept.built_for:
        return kept.decoder
    if kept is not None:
        kept.decoder.release()  # free the old cache and graph first
        del model._occult_decoder
    dec = StaticDecoder(model, batch, max_len, selector)
    if reuse:
        signature = ModelSignature(model)
        model._occult_decoder = KeptDecoder(key, dec, signature, signature())
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
    rank, or the MoE layers exchange over gloo, whose collectives a graph cannot record), True
    requires it, False runs eagerly. `reuse=True` keeps the decoder (cache, buffers,
    graph) on the model for the next call of the same padded batch and token choice whose prompt +
    new tokens fit its cache (as transformers reuses a large enough static cache; the keys past
    this call's length are masked); `del model._occult_decoder` frees it.
    """
    _check_args(input_ids, max_new_tokens, sync_every)
    sampling = Sampling(do_sample, temperature, top_k, top_p)  # checks the values
    group = model_group(model) if group is None else group
    world, _ = group_size(group)
    device = next(model.parameters()).device
    ids_BS, mask_BS, eos, pad = _prompts(model, input_ids, attention_mask, eos_token_id, pad_token_id, device)
    B, S = ids_BS.shape
    B_max, S_max, every = _agreed_sizes(B, S, max_new_tokens, sync_every, bool(eos), group, world, device)
    if B_max == 0:
        return ids_BS
    if B > 0 and S == 0:
        raise ValueError("prompts must hold at least one token")
    ids_PS, mask_PS = _pad_batch(ids_BS, mask_BS, B_max, pad)
    use_graph = _decode_captured(model, cuda_graph, device)

    if do_sample and seed is None:
        seed = _drawn_seed(generator)
    previous = [(m, m.sync_free) for m in model.modules() if isinstance(m, OccultMoE)]
    dec = None
    try:
        dec = _decoder(
            model, B_max, S_max + max_new_tokens, use_graph, reuse, TokenSelector(B_max, device, sampling, eos, pad)
        )
        set_sync_free(model, False)  # prefill: ranks' token counts may differ, normal dispatch
        logits_PV = dec.prefill(ids_PS, mask_PS)
        _decode_dispatch(model)
        # one new token: no decode step to capture; a rank whose model changed since the capture makes every rank
        # capture again (each capture's warm-up forwards exchange with the others')
        if use_graph and max_new_tokens > 1 and _agree([int(dec.needs_capture())], group, world, device)[0]:
            dec.release()
            _capture(dec, cuda_graph, group, world, device)
        dec.selector.reset(B, seed)  # after the capture: its warm-up draws do not count
        new = _decode(dec, logits_PV, max_new_tokens, every, group, world)
        return _until_eos(ids_BS, torch.stack(new, dim=1)[:B], eos, dec)
    finally:
        for m, flag in previous:
            m.sync_free = flag
        if dec is not None and not reuse:
            dec.release()  # the graph goes now: alive at destroy_process_group, it hangs the ranks


def _agreed_sizes(
    B: int, S: int, max_new_tokens: int, sync_every: int, has_eos: bool, group: Any, world: int, device: torch.device
) -> tuple[int, int, int]:
    """(the batch every rank pads to, the longest prompt, steps between "all done?" checks: 0 when no rank
    has an eos token) from one all-reduce, which also checks that `max_new_tokens` is equal everywhere."""
    B_max, S_max, n_max, neg_n_min, every, any_eos = _agree(
        [B, S, max_new_tokens, -max_new_tokens, sync_every, int(has_eos)], group, world, device
    )
    if n_max != -neg_n_min:
        raise ValueError(
            f"max_new_tokens differs between ranks ({-neg_n_min} to {n_max}); pass the same value on every rank"
        )
    return B_max, S_max, every if any_eos else 0


def _drawn_seed(generator: torch.Generator | None) -> int:
    """A seed for the decoder's sampling generator, drawn from `generator` (else torch's global RNG)."""
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(2**62, (1,), generator=generator, device=device))


def _decode_dispatch(model: nn.Module) -> None:
    """Decode steps must not wait for the GPU (they are captured, and run B tokens): each MoE layer
    over the device transport keeps it (exact rows, counts on the GPU); the others go sync-free."""
    for m in model.modules():
        if isinstance(m, OccultMoE):
            m.sync_free = m.dispatcher.transport_name != "device"


def _check_args(input_ids: torch.Tensor, max_new_tokens: int, sync_every: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")


def _prompts(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    eos_token_id: Any,
    pad_token_id: int | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
    """(ids [B, S], mask [B, S] long, eos ids, pad id) on the model's device, with the model's defaults."""
    gen_cfg = getattr(model, "generation_config", None)
    eos = _token_ids(eos_token_id if eos_token_id is not None else getattr(gen_cfg, "eos_token_id", None))
    if pad_token_id is None:
        pad_token_id = getattr(gen_cfg, "pad_token_id", None)
    ids_BS = input_ids.to(device)
    if attention_mask is None:
        infer = pad_token_id is not None and pad_token_id not in eos and bool((ids_BS == pad_token_id).any())
        attention_mask = (ids_BS != pad_token_id) if infer else torch.ones_like(ids_BS)
    mask_BS = attention_mask.to(device=device, dtype=torch.long)
    if mask_BS.shape != ids_BS.shape:
        raise ValueError(f"attention_mask {tuple(mask_BS.shape)} does not match input_ids {tuple(ids_BS.shape)}")
    pad = int(pad_token_id if pad_token_id is not None else (eos[0] if eos else 0))
    return ids_BS, mask_BS, eos, pad


def _pad_batch(ids_BS: torch.Tensor, mask_BS: torch.Tensor, B_max: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch padded to B_max rows; a rank with no prompts ([0, S]) steps with dummy rows of one attended pad."""
    B, S = ids_BS.shape
    S_own = max(S, 1)
    ids_PS = torch.cat([ids_BS[:, :S_own], ids_BS.new_full((B_max - B, S_own), pad)])
    mask_PS = torch.cat([mask_BS[:, :S_own], mask_BS.new_zeros((B_max - B, S_own))])
    mask_PS[B:, -1] = 1
    return ids_PS, mask_PS


def _decode_captured(model: nn.Module, cuda_graph: bool | str, device: torch.device) -> bool:
    """Whether the decode step is captured: `cuda_graph` True or "auto" on CUDA, MoE layers whose exchanges a
    graph can record (not gloo's: "auto" decodes those eagerly, True refuses them, as it refuses a CPU model)."""
    on_host = uncapturable_layers(model)  # (the same on every rank: every rank's layers share the group)
    if cuda_graph is True and device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs a CUDA model, this one is on {device.type}")
    if cuda_graph is True and on_host:
        raise ValueError(
            f"cuda_graph=True: {len(on_host)} MoE layer(s) exchange over a group whose collectives a CUDA graph "
            f"cannot record (gloo runs them on the host), e.g. {on_host[0]}: use NCCL, or cuda_graph='auto' "
            "to decode eagerly"
        )
    return device.type == "cuda" and cuda_graph in (True, "auto") and not on_host


def _capture(dec: StaticDecoder, cuda_graph: bool | str, group: Any, world: int, device: torch.device) -> None:
    """Capture the decode step; if it fails on any rank, every rank runs eagerly ("auto") or raises (True)."""
    error = None
    try:
        dec.capture()
    except Exception as exc:  # noqa: BLE001 (every rank learns of it below)
        error = exc
    if _agree([int(error is not None)], group, world, device)[0]:
        if cuda_graph is True:
            raise RuntimeError(f"CUDA-graph capture of the decode step failed on a rank: {error!r}") from error
        dec.graph = None


def _decode(
    dec: StaticDecoder, logits_PV: torch.Tensor, max_new_tokens: int, every: int, group: Any, world: int
) -> list[torch.Tensor]:
    """The new tokens: the first from the prefill's logits, then one per step; every `every` steps
    (0: never) the ranks ask whether all rows everywhere have finished."""
    unfinished_P = dec.selector.unfinished_B
    new = [dec.select(logits_PV).clone()]
    for t in range(1, max_new_tokens):
        if every and t % every == 0 and _all_done(~unfinished_P.any(), group, world):
            break
        dec.step()
        new.append(dec.next_B.clone())
    return new


def _until_eos(ids_BS: torch.Tensor, new_BN: torch.Tensor, eos: list[int], dec: StaticDecoder) -> torch.Tensor:
    """Prompts and new tokens, cut where this rank alone would have stopped (all its rows past an eos)."""
    n = new_BN.shape[1]
    if eos and ids_BS.shape[0] > 0:
        hit_BN = torch.isin(new_BN, dec.selector.eos_E)
        first_B = torch.where(hit_BN.any(1), hit_BN.int().argmax(1) + 1, n)
        n = int(first_B.max())
    return torch.cat([ids_BS, new_BN[:, :n]], dim=1)
