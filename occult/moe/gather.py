"""Moving rows between a token layout and a plan's row layout, with their gradients.

`gather_rows` copies each plan row's token activation (backward: the sum of a token's row
gradients), `gather_gate_weights` each row's gate weights (backward: a plain scatter),
`sum_rows` adds a token's result rows (fp32 accumulation; backward: each row gets its token's
gradient). `gather_early` makes the first two (and the packed metadata) before the host waits
for the counts. On GPUs the sums run as one Triton pass (`occult.kernels.rows`).
"""

from __future__ import annotations

import torch

from occult.moe.comm import pack_metadata
from occult.moe.plan import DispatchPlan


def triton_sums(t: torch.Tensor) -> bool:
    """The Triton row sums (fp32 accumulation) serve bf16/fp16/fp32 CUDA tensors."""
    if not t.is_cuda or t.dtype == torch.float64:
        return False
    from occult import kernels

    return kernels.available(t.device)


def token_sum(
    src_PH: torch.Tensor, token_P: torch.Tensor, row_TJ: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """Sum each token's rows (fp32 accumulation): one pass on GPU, `index_add` elsewhere."""
    if triton_sums(src_PH):
        from occult.kernels.rows import gather_sum

        return gather_sum(src_PH, row_TJ, out_dtype)
    acc = torch.promote_types(src_PH.dtype, torch.float32)
    num_tokens = row_TJ.shape[0]
    out = src_PH.new_zeros((num_tokens + 1, src_PH.shape[1]), dtype=acc)  # + a spare row for padding rows (-1)
    index = torch.where(token_P >= 0, token_P, num_tokens)
    return out.index_add_(0, index, src_PH.to(acc))[:num_tokens].to(out_dtype)


class _GatherRows(torch.autograd.Function):
    """rows = x[token_P] (`early`: the same rows, gathered before the host sync); backward sums
    each token's row gradients (no atomics on GPU)."""

    @staticmethod
    def forward(ctx, x_TH, token_P, row_TJ, early_PH=None):
        ctx.save_for_backward(token_P, row_TJ)
        return x_TH[token_P] if early_PH is None else early_PH

    @staticmethod
    def backward(ctx, grad_PH):
        token_P, row_TJ = ctx.saved_tensors
        return token_sum(grad_PH, token_P, row_TJ, grad_PH.dtype), None, None, None


def gather_gates(weights_TK: torch.Tensor, entry_PK: torch.Tensor) -> torch.Tensor:
    """gates[p, j] = weights.flat[entry[p, j]], 0 where entry is -1 (padding)."""
    padded = torch.cat([weights_TK.reshape(-1), weights_TK.new_zeros(1)])
    return padded[torch.where(entry_PK >= 0, entry_PK, weights_TK.numel())]


def scatter_gates(grad_PK: torch.Tensor, entry_PK: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Backward of `gather_gates`: every valid entry occurs once, so a plain scatter (no
    accumulation); padding entries all land in one spare slot that is dropped. (Autograd's own
    indexing backward would accumulate the padding's duplicates one by one.)"""
    n = shape.numel()
    buf = grad_PK.new_zeros(n + 1)
    buf.scatter_(0, torch.where(entry_PK >= 0, entry_PK, n).reshape(-1), grad_PK.reshape(-1))
    return buf[:n].view(shape)


class _GatherGates(torch.autograd.Function):
    """`gather_gates` (`early`: its result, made before the host sync) with `scatter_gates` as its backward."""

    @staticmethod
    def forward(ctx, weights_TK, entry_PK, early_PK=None):
        ctx.save_for_backward(entry_PK)
        ctx.shape = weights_TK.shape
        return gather_gates(weights_TK, entry_PK) if early_PK is None else early_PK

    @staticmethod
    def backward(ctx, grad_PK):
        (entry_PK,) = ctx.saved_tensors
        return scatter_gates(grad_PK, entry_PK, torch.Size(ctx.shape)), None, None


def gather_early(x_TH: torch.Tensor, weights_TK: torch.Tensor, plan: DispatchPlan) -> tuple[torch.Tensor, ...]:
    """Rows, gates and packed metadata of every row a capacity-sized plan may send (the tail is
    padding): queued before the host waits for the counts, so that after the wait only the
    all-to-alls and the experts are launched (the forward is host-bound: docs/overlap.md).
    Costs the padding rows' gather on the GPU (capacity T*min(k, D) rows vs the sent ones)."""
    with torch.no_grad():
        gates_PK = gather_gates(weights_TK, plan.entry_PK)
        return x_TH[plan.token_P], gates_PK, pack_metadata(gates_PK, plan.slot_PK)


class _SumRows(torch.autograd.Function):
    """y[t] = sum of token t's rows; backward hands each row its token's gradient."""

    @staticmethod
    def forward(ctx, y_PH, token_P, row_TJ):
        ctx.save_for_backward(token_P, row_TJ)
        return token_sum(y_PH, token_P, row_TJ, y_PH.dtype)

    @staticmethod
    def backward(ctx, grad_TH):
        token_P, _ = ctx.saved_tensors
        return grad_TH[token_P], None, None


def gather_rows(
    x_TH: torch.Tensor, token_P: torch.Tensor, row_TJ: torch.Tensor, early_PH: torch.Tensor | None = None
) -> torch.Tensor:
    """rows[p] = x[token[p]] (`early_PH`: the same rows, gathered before the host sync); differentiable."""
    return _GatherRows.apply(x_TH, token_P, row_TJ, early_PH)


def gather_gate_weights(
    weights_TK: torch.Tensor, entry_PK: torch.Tensor, early_PK: torch.Tensor | None = None
) -> torch.Tensor:
    """`gather_gates`, differentiable with `scatter_gates` as its backward (`early_PK`: made before the sync)."""
    return _GatherGates.apply(weights_TK, entry_PK, early_PK)


def sum_rows(y_PH: torch.Tensor, token_P: torch.Tensor, row_TJ: torch.Tensor) -> torch.Tensor:
    """y[t] = sum of token t's rows (fp32 accumulation, returned in the rows' dtype); differentiable."""
    return _SumRows.apply(y_PH, token_P, row_TJ)
