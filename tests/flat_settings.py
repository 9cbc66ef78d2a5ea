"""``LossSettings`` for the algo tests, from the flat keys the tests spell their cases in.

The policy-loss keys (``loss_type``, ``clip_low``, ``clip_high``, ``clip_c``, ``agg``,
``norm_constant``) are required; ``m2_threshold`` defaults to the paper's 0.04 (only ``m2po`` reads
it), ``mode`` to ``bypass`` (the per-mode functions ignore it),
the ``algo.correction.*`` keys to no correction at all, and there is no KL penalty.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from asyncgrpo.algo import CorrectionSettings, LossSettings

NO_CORRECTION = {"is_level": None, "is_threshold": 2.0, "is_batch_normalize": False, "rs": None, "rs_threshold": None}
SETTINGS_KEYS = {field.name for field in dataclasses.fields(LossSettings)} - {"correction", "kl"} | set(NO_CORRECTION)


def flat_settings(mode: str = "bypass", **keys: Any) -> LossSettings:
    correction = NO_CORRECTION | {key: keys.pop(key) for key in NO_CORRECTION if key in keys}
    keys.setdefault("m2_threshold", 0.04)  # read by loss_type m2po alone
    return LossSettings(mode=mode, **keys, correction=CorrectionSettings(**correction), kl=None)


def call_with_settings(function: Callable[..., Any], *tensors: Any, **arguments: Any) -> Any:
    """``function(*tensors, settings=..., **rest)``: the settings built from the config keys among
    ``arguments`` (inside the caller's ``pytest.raises``, so an invalid one is caught there), the rest
    (tensors by name, ``is_weights``, the global counts) passed on."""
    keys = {key: arguments.pop(key) for key in list(arguments) if key in SETTINGS_KEYS}
    return function(*tensors, settings=flat_settings(**keys), **arguments)
