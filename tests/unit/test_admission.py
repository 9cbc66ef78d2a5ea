"""Divergence-gated staleness in the learner: update() measures the divergence by token age on the
log-probs its loss already has (the same numbers as mismatch/k3_kl), applies train.divergence_cap,
and AdmissionControl hands the controller's bound to the group source after every step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_update_modes import groups

from asyncgrpo.config import load
from asyncgrpo.learner.admission import AdmissionControl, step_buckets
from asyncgrpo.learner.batch import collate
from asyncgrpo.learner.policy import Policy
from asyncgrpo.learner.update import update
from asyncgrpo.models.tiny import TinyModelSpec, build_model
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.queue.bound_control import HOLD_STEPS
from asyncgrpo.queue.sources import ListSource


def one_update(*overrides: str, num_groups: int = 3, version: int = 2,
               sampled: tuple[int, ...] = (0,)) -> dict[str, float]:
    """One update on the tiny model; group g's tokens sampled by version sampled[g % len(sampled)]."""
    cfg = load(["learner.warmup_steps=0", *overrides])
    tokenizer = build_char_tokenizer()
    model = build_model(TinyModelSpec.from_config(cfg.model), tokenizer, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    policy = Policy(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), None,
                    torch.device("cpu"), torch.device("cpu"), rank=0, temperature=cfg.rollout.temperature)
    stale = [dataclasses.replace(g, versions=np.full_like(g.versions, sampled[i % len(sampled)]))
             for i, g in enumerate(groups(num_groups))]
    return update(policy, collate(stale, tokenizer.pad_token_id), cfg, rank=0, world_size=1,
                  max_new_tokens=cfg.rollout.max_new_tokens, version=version)


@pytest.mark.parametrize("mode", ["bypass", "decoupled"])
def test_the_divergence_of_one_age_is_the_mismatch_k3_the_loss_already_computed(mode):
    metrics = one_update(f"algo.mode={mode}")
    assert metrics["divergence/k3_age_2"] == pytest.approx(metrics["mismatch/k3_kl"], rel=1e-5)
    assert metrics["divergence/mean_age_2"] == 2
    assert not any(key.startswith("divergence/k3_age_") and key != "divergence/k3_age_2" for key in metrics)


def test_tokens_are_bucketed_by_their_age_and_older_buckets_lump_into_4plus():
    metrics = one_update(num_groups=4, version=6, sampled=(6, 5, 1, 0))
    assert {key for key in metrics if key.startswith("divergence/k3_age_")} == {
        "divergence/k3_age_0", "divergence/k3_age_1", "divergence/k3_age_4plus"}
    assert metrics["divergence/mean_age_4plus"] > 5  # ages 5 and 6
    assert sum(v for k, v in metrics.items() if k.startswith("divergence/tokens_age_")) == sum(
        int(g.lengths.sum()) for g in groups(4))


def test_a_dropped_group_adds_nothing_to_the_loss_and_is_counted():
    capped = one_update("train.divergence_cap=1e-9")  # every group is beyond it
    assert capped["divergence/capped_groups"] == 3
    assert capped["loss/pg"] == 0 and capped["optim/grad_norm"] == 0
    assert one_update()["divergence/capped_groups"] == 0


def test_a_downweighted_group_has_its_loss_scaled_by_cap_over_its_mean_k3():
    plain = one_update(num_groups=1)
    cap = plain["mismatch/k3_kl"] / 4  # one group in one micro-batch: its mean k3 is mismatch/k3_kl
    weighted = one_update(f"train.divergence_cap={cap}", "train.divergence_cap_action=downweight", num_groups=1)
    assert weighted["divergence/capped_groups"] == 1
    assert weighted["loss/pg"] == pytest.approx(plain["loss/pg"] / 4, rel=1e-4)


class BoundSource(ListSource):
    """A list source that records the admission bounds it is given."""

    def __init__(self) -> None:
        super().__init__([])
        self.bounds: list[int] = []

    def set_admission_bound(self, bound: int) -> None:
        self.bounds.append(bound)


def step_metrics(rate: float, bound: int, capped: int = 0) -> dict[str, float]:
    """update()'s divergence/* for a step whose tokens are at ages 0 .. bound, divergence rate * age^2."""
    metrics: dict[str, float] = {"divergence/capped_groups": float(capped)}
    for age in range(bound + 1):
        metrics |= {f"divergence/k3_age_{age}": rate * age ** 2, f"divergence/ess_age_{age}": 1.0,
                    f"divergence/tokens_age_{age}": 100.0, f"divergence/mean_age_{age}": float(age)}
    return metrics


def test_under_divergence_control_the_source_gets_the_starting_bound_and_every_step_s():
    cfg = load(["train.staleness_control=divergence", "train.max_staleness=4", "train.min_staleness=1",
                "train.divergence_target=0.1"])
    source = BoundSource()
    control = AdmissionControl(cfg, source)
    assert source.bounds == [1]  # min_staleness, before any grant
    records = [control.after_step(step_metrics(0.005, control.bound, capped=1)) for _ in range(4 * HOLD_STEPS)]
    assert source.bounds[1:] == [r["divergence/bound"] for r in records]
    assert records[-1]["divergence/bound"] == 4  # 0.005 a^2 holds 0.1 up to max_staleness
    assert control.summary() == {"admission_bound": 4, "capped_groups": 4 * HOLD_STEPS}
    resumed = AdmissionControl(cfg, BoundSource())
    resumed.load_state_dict(control.state_dict())
    assert resumed.bound == 4 and resumed.source.bounds[-1] == 4


def test_under_version_control_nothing_is_set_and_the_bound_is_max_staleness():
    source = BoundSource()
    control = AdmissionControl(load([]), source)
    assert control.after_step(step_metrics(5.0, 2)) == {"divergence/bound": 2.0}
    assert source.bounds == []
    control.load_state_dict({})  # a checkpoint from before divergence control
    assert control.summary()["capped_groups"] == 0


def test_the_ess_metric_is_controlled_as_minus_log_ess():
    metrics = {"divergence/k3_age_1": 0.3, "divergence/ess_age_1": 0.5, "divergence/tokens_age_1": 10.0,
               "divergence/mean_age_1": 1.0, "divergence/bound": 3.0}
    assert step_buckets(metrics, "ess") == [(1.0, 10.0, pytest.approx(np.log(2)))]
    assert step_buckets(metrics, "kl") == [(1.0, 10.0, 0.3)]
