"""Masked reductions and metric conversion shared by the loss and correction modules.

``keep`` is always a bool tensor (True on real response tokens). Masked-out positions are filled
rather than multiplied by zero, so an infinite value on padding cannot turn into NaN. Means divide
by max(count, 1): identical to verl's ``sum / (count + 1e-8)`` whenever there is a real token, and 0
instead of 0/1e-8 when there is none.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, keep: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    filled = values.masked_fill(~keep, 0)
    return filled.sum() if dim is None else filled.sum(dim)


def masked_mean(values: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Mean over the kept entries; bool ``values`` give the kept fraction (in ``dtype``)."""
    if dtype is not None:
        values = values.to(dtype)
    return masked_sum(values, keep) / keep.sum().clamp_min(1)


def masked_row_mean(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B] mean over each row's kept tokens (0 for an empty row)."""
    return masked_sum(values, keep, dim=-1) / keep.sum(-1).clamp_min(1)


def masked_max(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Largest kept entry, 0 when nothing is kept."""
    if values.numel() == 0:
        return values.new_zeros(())
    return torch.where(keep.any(), values.masked_fill(~keep, -torch.inf).max(), 0)


def masked_min(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Smallest kept entry, 0 when nothing is kept."""
    if values.numel() == 0:
        return values.new_zeros(())
    return torch.where(keep.any(), values.masked_fill(~keep, torch.inf).min(), 0)


def to_floats(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """Scalar tensors -> plain floats with a single device sync."""
    if not stats:
        return {}
    values = torch.stack([value.detach().to(torch.float64).reshape(()) for value in stats.values()])
    return dict(zip(stats, values.tolist(), strict=True))
