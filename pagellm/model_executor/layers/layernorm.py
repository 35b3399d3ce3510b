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


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, x * rsqrt(mean(x^2) + eps) * (1 + w) in float32 before the cast back. `weight` holds 1 + w
    (the model adds the 1 at load) in float32 whatever the model's dtype, as Gemma computes 1 + w; so the C kernel
    of RMSNorm computes it unchanged on float32 activations."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x, residual)
        if residual is not None:
            x = residual.add_(x)
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)
