"""Multi-turn completions through the learner: only the tokens the policy sampled are trained.

A completion is the policy's turns with an environment's observations between them; the group's
policy mask (wire schema 8) says which token is whose, and `collate` makes it the batch's `mask`.
Golden checks on the tiny model, in-process: an environment token's rollout log-prob, target id and
version change neither the loss nor any gradient; the denominators count policy tokens only; a
hole in the middle of a completion cuts nothing when micro-batches are selected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
import torch

from asyncgrpo import algo
from asyncgrpo.config import load
from asyncgrpo.learner.batch import Batch, collate
from asyncgrpo.learner.metrics import batch_metrics
from asyncgrpo.learner.policy import Policy
from asyncgrpo.learner.update import update
from asyncgrpo.models.tiny import TinyModelSpec, build_model
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.wire import ScoredGroup

P, E = 1, 0  # policy mask entries: sampled by the policy, inserted by an environment


def group(masks: list[list[int]], rewards: list[float], seq: int = 0, seed: int = 0) -> ScoredGroup:
    """Completions shaped by `masks`; the policy's tokens have rollout log-probs near the tiny
    model's and version 3, the environment's log-prob 0 and version 1 (both ignored)."""
    rng = np.random.default_rng(seed)
    policy_mask = np.concatenate([np.asarray(m, np.uint8) for m in masks])
    total = policy_mask.size
    return ScoredGroup(
        generator_id=0, seq=seq, prompt_id=seq, prompt_tokens=rng.integers(3, 60, size=3).astype(np.int32),
        tokens=rng.integers(1, 60, size=total).astype(np.int32),
        logprobs=np.where(policy_mask == 1, -rng.uniform(3.9, 4.3, size=total), 0.0).astype(np.float32),
        versions=np.where(policy_mask == 1, 3, 1).astype(np.int32),
        lengths=np.array([len(m) for m in masks], np.int32), rewards=np.array(rewards, np.float32),
        meta={"version": 3}, policy_mask=policy_mask)


def multi_turn_groups() -> list[ScoredGroup]:
    """Two groups of 4: [turn][observation][turn], one ending in an observation (cut by the budget),
    single-turn ones, and one with an observation right after the first token."""
    return [
        group([[P, P, E, E, P], [P, P], [P, E, E, E, P, P], [P, P, P]], [1.0, 0.0, 0.0, 1.0], seq=0, seed=0),
        group([[P, E, P, P], [P, P, E, E], [P, P, P, P, P], [P, E, E, P]], [0.0, 1.0, 1.0, 0.0], seq=1, seed=1),
    ]


def environment_tokens(batch: Batch) -> torch.Tensor:
    """[B, T] bool: the completion columns the policy did not sample."""
    columns = torch.arange(batch.mask.shape[1]).unsqueeze(0)
    return (columns < batch.completion_lengths.unsqueeze(1)) & (batch.mask == 0)


def tiny_policy(cfg, with_reference: bool) -> Policy:
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_model(TinyModelSpec.from_config(cfg.model), tokenizer, seed=0)
    reference = build_model(TinyModelSpec.from_config(cfg.model), tokenizer, seed=1) if with_reference else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return Policy(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), reference,
                  torch.device("cpu"), torch.device("cpu"), rank=0, temperature=cfg.rollout.temperature)


def step(overrides: tuple[str, ...], change: Callable[[Batch], Batch] = lambda b: b,
         groups: list[ScoredGroup] | None = None) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One update from the same initial weights on the (changed) batch: its metrics (time/* left
    out) and every parameter's gradient."""
    cfg = load(["learner.warmup_steps=0", "rollout.max_new_tokens=8", *overrides])
    policy = tiny_policy(cfg, with_reference=cfg.algo.kl.enabled)
    batch = change(collate(groups or multi_turn_groups(), build_char_tokenizer().pad_token_id))
    metrics = update(policy, batch, cfg, rank=0, world_size=1, max_new_tokens=cfg.rollout.max_new_tokens)
    return ({k: v for k, v in metrics.items() if not k.startswith("time/")},
            [p.grad.detach().clone() for p in policy.model.parameters()])


def changed(batch: Batch, name: str, value: Callable[[torch.Tensor], torch.Tensor],
            where: Callable[[Batch], torch.Tensor] = environment_tokens) -> Batch:
    """`batch` with field `name` replaced by `value(field)` at the positions `where(batch)`."""
    field = getattr(batch, name)
    at = where(batch)
    assert at.any()
    return dataclasses.replace(batch, **{name: torch.where(at, value(field).to(field.dtype), field)})


ENVIRONMENT_TOKEN_CHANGES: dict[str, Callable[[Batch], Batch]] = {
    "rollout log-prob": lambda b: changed(b, "rollout_logp", lambda x: torch.full_like(x, -30.0)),
    "target id": lambda b: changed(b, "targets", lambda x: (x + 7) % 59 + 1),
    "version": lambda b: changed(b, "token_versions", lambda x: x + 5),
    "all three": lambda b: ENVIRONMENT_TOKEN_CHANGES["version"](ENVIRONMENT_TOKEN_CHANGES["target id"](
        ENVIRONMENT_TOKEN_CHANGES["rollout log-prob"](b))),
}

# Every aggregation mode with the KL penalty on, and the other loss types and modes once each.
SETTINGS = [(f"algo.agg={agg}", "algo.kl.enabled=true", "algo.kl.coef=0.1") for agg in algo.AGG_MODES] + [
    ("algo.loss_type=gspo", "algo.agg=seq-mean-token-mean"),
    ("algo.loss_type=cispo",),
    ("algo.loss_type=reinforce", "algo.correction.is_level=sequence"),
    ("algo.mode=decoupled", "algo.correction.is_level=token", "algo.kl.enabled=true"),
]


@pytest.fixture(scope="module")
def baselines() -> dict[tuple[str, ...], tuple[dict[str, float], list[torch.Tensor]]]:
    return {}


@pytest.mark.parametrize("what", list(ENVIRONMENT_TOKEN_CHANGES))
@pytest.mark.parametrize("overrides", SETTINGS, ids=lambda o: ",".join(o))
def test_an_environment_tokens_logprob_target_and_version_change_neither_the_loss_nor_any_gradient(
        what, overrides, baselines):
    if overrides not in baselines:
        baselines[overrides] = step(overrides)
    metrics, grads = baselines[overrides]
    changed_metrics, changed_grads = step(overrides, ENVIRONMENT_TOKEN_CHANGES[what])
    assert changed_metrics == metrics
    assert all(torch.equal(a, b) for a, b in zip(grads, changed_grads, strict=True))
    assert any(g.abs().sum() > 0 for g in grads)  # there was a gradient to change


def test_the_same_change_on_a_policy_token_changes_the_loss_and_the_gradient():
    # The sensitivity the test above relies on: on a policy token, each change shows.
    def policy_tokens(batch: Batch) -> torch.Tensor:
        return batch.mask.bool()

    overrides = ("algo.kl.enabled=true", "algo.kl.coef=0.1")
    metrics, grads = step(overrides)
    for name, value in (("rollout_logp", lambda x: torch.full_like(x, -30.0)), ("targets", lambda x: (x + 7) % 59 + 1)):
        changed_metrics, changed_grads = step(overrides, lambda b: changed(b, name, value, policy_tokens))
        assert changed_metrics["loss/total"] != metrics["loss/total"], name
        assert not all(torch.equal(a, b) for a, b in zip(grads, changed_grads)), name


# ------------------------------------------------------------------------------ denominators


def hand_loss(agg: str, max_new_tokens: int) -> float:
    """reinforce's loss -A * logp over the policy tokens of [P P E E P] and [P P] (rewards 1, 0),
    with each aggregation's denominator written out: 5 policy tokens (not 7), 2 sequences."""
    groups = [group([[P, P, E, E, P], [P, P]], [1.0, 0.0])]
    cfg = load(["learner.warmup_steps=0", f"rollout.max_new_tokens={max_new_tokens}"])
    policy = tiny_policy(cfg, with_reference=False)
    policy.model.train()
    with torch.no_grad():
        logp = policy.logprobs(collate(groups, build_char_tokenizer().pad_token_id))
    advantages = algo.group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mode="grpo")
    first = [-advantages[0] * logp[0, t] for t in (0, 1, 4)]
    second = [-advantages[1] * logp[1, t] for t in (0, 1)]
    sums = (sum(first), sum(second))
    value = {
        "token-mean": (sums[0] + sums[1]) / 5,
        "seq-mean-token-sum": (sums[0] + sums[1]) / 2,
        "seq-mean-token-mean": (sums[0] / 3 + sums[1] / 2) / 2,
        "seq-mean-token-sum-norm": (sums[0] + sums[1]) / 2 / max_new_tokens,
    }[agg]
    return float(value)


@pytest.mark.parametrize("micro_batch_tokens", [0, 8])
@pytest.mark.parametrize("agg", algo.AGG_MODES)
def test_the_denominators_count_policy_tokens_only_and_a_hole_cuts_nothing(agg, micro_batch_tokens):
    # micro_batch_tokens=8: each row its own micro-batch through Batch.select. The first row's last
    # policy token (column 4) lies beyond its 3 policy tokens: trimming to the mask's row sums would cut it.
    groups = [group([[P, P, E, E, P], [P, P]], [1.0, 0.0])]
    metrics, _ = step(("algo.loss_type=reinforce", f"algo.agg={agg}", f"learner.micro_batch_tokens={micro_batch_tokens}"),
                      groups=groups)
    assert metrics["perf/micro_batches"] == (2 if micro_batch_tokens else 1)
    assert metrics["loss/pg"] == pytest.approx(hand_loss(agg, 8), rel=1e-5, abs=1e-7)


def test_select_keeps_every_column_a_row_uses_however_many_are_masked():
    batch = collate([group([[P, E, E, E, P, P], [P, P, P, P]], [1.0, 0.0])], pad_id=0)
    assert batch.mask.sum(1).tolist() == [3, 4] and batch.completion_lengths.tolist() == [6, 4]
    for index in ([0], [1, 0], [0, 1]):
        rows = torch.tensor(index)
        selected = batch.select(rows)
        width = int(batch.completion_lengths[rows].max())
        assert selected.targets.shape[1] == width
        for name in ("mask", "targets", "logit_index", "rollout_logp", "token_versions"):
            assert torch.equal(getattr(selected, name), getattr(batch, name)[rows, :width]), name
        assert torch.equal(selected.completion_lengths, batch.completion_lengths[rows])


# ------------------------------------------------------------------------------ collate and metrics


def test_collate_makes_the_policy_mask_the_batch_mask_and_ignores_the_environments_logprobs_and_versions():
    g = group([[P, P, E, E, P], [P, E]], [1.0, 0.0])
    g.logprobs[2] = -7.0  # a sender that did not write 0 there: ignored all the same
    batch = collate([g], pad_id=0)
    assert batch.mask.tolist() == [[1, 1, 0, 0, 1], [1, 0, 0, 0, 0]]
    assert batch.completion_lengths.tolist() == [5, 2]
    assert batch.targets[0].tolist() == g.tokens[:5].tolist()  # observations stay in the sequence
    assert batch.input_ids[1, 3:5].tolist() == g.tokens[5:7].tolist()
    assert batch.rollout_logp[0, 2:4].tolist() == [0.0, 0.0] and batch.rollout_logp[1, 1] == 0.0
    assert batch.rollout_logp[0, 4] == pytest.approx(float(g.logprobs[4]))
    assert batch.group_version_min.tolist() == [3]  # not the observations' version 1
    assert batch.num_tokens == 4


def test_step_metrics_count_lengths_over_all_tokens_and_staleness_over_the_policys():
    batch = collate([group([[P, P, E, E, P], [P, E]], [1.0, 0.0])], pad_id=0)
    metrics = batch_metrics(batch, torch.tensor([1]), version=5, samples_consumed=2, max_new_tokens=5)
    assert metrics["response/env_token_frac"] == pytest.approx(3 / 7)
    assert (metrics["response/length_mean"], metrics["response/length_max"]) == (3.5, 5)
    assert metrics["response/clipped_frac"] == 0.5  # the budget counts observations too
    assert metrics["prompt/length_mean"] == 3.0
    assert metrics["perf/tokens"] == 4
    # Trained at version 4: every policy token is version 3, age 1; the observations' version 1 counts nowhere.
    assert metrics["staleness/tokens_age_1"] == 1.0 and metrics["staleness/tokens_age_3"] == 0.0
    assert metrics["staleness/inflight_span_max"] == 0
