"""Argument validation shared by the algorithm modules.

Every check raises ``ValueError`` with a message that starts with the offending argument's name,
so a bad configuration value can be traced back to its config key.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from numbers import Real

import torch


def check_choice(name: str, value: object, choices: Collection[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")
    return value


def check_real(name: str, value: object) -> float:
    # bool is a subclass of int: `clip_low=True` is a config typo, not the number 1.
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    as_float = float(value)
    if math.isnan(as_float):
        raise ValueError(f"{name} must not be NaN")
    return as_float


def check_positive(name: str, value: object) -> float:
    as_float = check_real(name, value)
    if as_float <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return as_float


def check_optional_count(name: str, value: object) -> float | None:
    if value is None:
        return None
    as_float = check_real(name, value)
    if as_float < 0 or math.isinf(as_float):
        raise ValueError(f"{name} must be a finite count >= 0, got {value!r}")
    return as_float


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def check_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.is_floating_point() and bool(torch.isnan(value).any()):
        raise ValueError(f"{name} contains NaN")
    return value


def check_float_tensor(name: str, value: object) -> torch.Tensor:
    tensor = check_tensor(name, value)
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")
    return tensor


def check_token_tensor(name: str, value: object) -> torch.Tensor:
    tensor = check_float_tensor(name, value)
    if tensor.dim() != 2:
        raise ValueError(f"{name} must have shape [B, T], got {tuple(tensor.shape)}")
    return tensor


def check_same_shape(name: str, tensor: torch.Tensor, reference_name: str, reference: torch.Tensor) -> None:
    if tensor.shape != reference.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but {reference_name} has shape {tuple(reference.shape)}"
        )


def check_mask(mask: object, reference_name: str, reference: torch.Tensor, name: str = "mask") -> torch.Tensor:
    """Validate a 0/1 mask shaped like ``reference`` and return it as a bool tensor."""
    tensor = check_tensor(name, mask)
    check_same_shape(name, tensor, reference_name, reference)
    if tensor.dtype == torch.bool:
        return tensor
    if not bool(((tensor == 0) | (tensor == 1)).all()):
        raise ValueError(f"{name} must contain only 0 and 1")
    return tensor != 0
