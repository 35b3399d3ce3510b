"""RMSNorm, computed in float32 like the reference implementations, optionally fused with the residual add."""
import torch
from torch import nn

from pagellm.kernels import elementwise


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x); with `residual`: residual += x in place, then norm(residual) (one pass, as vLLM fuses it)."""
        if elementwise.applies(x) and x.is_contiguous() and (residual is None or residual.is_contiguous()):
            return elementwise.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = residual.add_(x)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
