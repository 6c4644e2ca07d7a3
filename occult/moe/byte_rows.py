"""The device transport's rows as bytes: one dispatched row's layout, and where rows land in the
region-per-source receive buffers (`occult.moe.symm`); used by `occult.moe.device_exchange`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from occult.moe.transport_buffers import row_bytes


@dataclass(frozen=True)
class RowLayout:
    """One dispatched row in bytes: the activation, then K gates (fp32, fp64 for fp64 gates) and K
    slots (int32); a returned row holds the activation only. Both padded (`symm.row_bytes`)."""

    hidden: int
    dtype: torch.dtype
    top_k: int
    gates_dtype: torch.dtype

    @property
    def carrier(self) -> torch.dtype:
        return torch.float64 if self.gates_dtype == torch.float64 else torch.float32

    @property
    def x_bytes(self) -> int:
        return -(-self.hidden * torch.finfo(self.dtype).bits // 8 // 16) * 16

    @property
    def gate_bytes(self) -> int:
        return self.top_k * torch.finfo(self.carrier).bits // 8

    @property
    def width(self) -> int:
        return row_bytes(self.x_bytes + self.gate_bytes + 4 * self.top_k)

    @property
    def back_width(self) -> int:
        return row_bytes(self.hidden * torch.finfo(self.dtype).bits // 8)

    def write(
        self,
        buf_NW: torch.Tensor,
        x_NH: torch.Tensor,
        gates_NK: torch.Tensor | None = None,
        slots_NK: torch.Tensor | None = None,
    ) -> None:
        """Write rows (and their gates, slots) into the first rows of a byte buffer."""
        n = x_NH.shape[0]
        buf_NW[:n].view(self.dtype)[:, : self.hidden].copy_(x_NH)
        if gates_NK is not None:
            g0, s0 = self.x_bytes, self.x_bytes + self.gate_bytes
            buf_NW[:n, g0:s0].view(self.carrier).copy_(gates_NK)
            if slots_NK is not None:
                buf_NW[:n, s0 : s0 + 4 * self.top_k].view(torch.int32).copy_(slots_NK)

    def read_x(self, buf_NW: torch.Tensor, n: int) -> torch.Tensor:
        """The first n rows' activations, copied out of the buffer (it is reused by the next all-to-all)."""
        return buf_NW[:n].view(self.dtype)[:, : self.hidden].contiguous()

    def read_gates(self, buf_NW: torch.Tensor, n: int) -> torch.Tensor:
        return buf_NW[:n, self.x_bytes : self.x_bytes + self.gate_bytes].view(self.carrier).to(self.gates_dtype)

    def read_slots(self, buf_NW: torch.Tensor, n: int) -> torch.Tensor:
        s0 = self.x_bytes + self.gate_bytes
        return buf_NW[:n, s0 : s0 + 4 * self.top_k].view(torch.int32).to(torch.int64)


def region_valid(num_rows: int, stride: int, counts_D: torch.Tensor) -> torch.Tensor:
    """[num_rows, 1] bool: row i of a region-per-source buffer holds data (i % stride < counts_D[i // stride])."""
    row_R = torch.arange(num_rows, device=counts_D.device)
    return ((row_R % stride) < counts_D[row_R // stride])[:, None]


def region_index(rows: torch.Tensor, counts_D: torch.Tensor, stride: int) -> torch.Tensor:
    """Where rows listed in plan order (packed by destination: `counts_D[d]` rows to rank d) come back
    in a region-per-rank buffer: row p sent to rank d at region d, row p - start_d. `rows`: row
    numbers, any shape; -1 (none) and rows past the total stay -1. One kernel on a GPU."""
    from occult import kernels

    if counts_D.is_cuda and kernels.available(counts_D.device):
        from occult.kernels.push import region_rows

        return region_rows(rows, counts_D, stride)
    ends_D = torch.cumsum(counts_D, 0)
    row = rows.clamp(min=0)
    dest = torch.bucketize(row, ends_D, right=True).clamp_(max=counts_D.shape[0] - 1)
    index = dest * stride + row - (ends_D - counts_D)[dest]
    return torch.where((rows >= 0) & (rows < ends_D[-1]), index, -1)


def as_byte_rows(t_NH: torch.Tensor, width: int) -> torch.Tensor | None:
    """`t_NH`'s own memory as byte rows of `width` (no copy), where its rows are exactly that wide."""
    if t_NH.is_contiguous() and t_NH.shape[1] * t_NH.element_size() == width:
        return t_NH.view(torch.uint8).view(t_NH.shape[0], width)
    return None
