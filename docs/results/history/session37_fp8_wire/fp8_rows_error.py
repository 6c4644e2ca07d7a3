"""Session 37, CPU: how far an expert MLP's output moves when its input rows travel in fp8 (per-row or 1x128
scales) instead of bf16. Random OLMoE-sized expert (hidden 2048, ffn 1024), 512 rows with varied norms and a few
outlier channels; relative L2 error against the fp32 input. `python fp8_rows_error.py`"""

import torch


def main() -> None:
    torch.manual_seed(0)
    hidden, ffn, rows = 2048, 1024, 512
    x = torch.randn(rows, hidden) * (1 + 3 * torch.rand(rows, 1))
    x[:, :8] *= 20  # a few outlier channels, as real activations have
    w1, w3 = torch.randn(ffn, hidden) / hidden**0.5, torch.randn(ffn, hidden) / hidden**0.5
    w2 = torch.randn(hidden, ffn) / ffn**0.5

    def mlp(t: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.silu(t @ w1.T) * (t @ w3.T)) @ w2.T

    ref = mlp(x)

    def rel(t: torch.Tensor) -> float:
        return ((mlp(t) - ref).norm() / ref.norm()).item()

    print(f"bf16 rows: {rel(x.bfloat16().float()):.4f}")
    for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
        top = torch.finfo(fmt).max
        scale = x.abs().amax(1, keepdim=True) / top
        per_row = (x / scale).to(fmt).float() * scale
        blocks = x.view(rows, hidden // 128, 128)
        scale = blocks.abs().amax(-1, keepdim=True) / top
        per_block = ((blocks / scale).to(fmt).float() * scale).view(rows, hidden)
        print(f"{fmt}: per-row scale {rel(per_row):.4f}, 1x128 scales {rel(per_block):.4f}")


if __name__ == "__main__":
    main()
