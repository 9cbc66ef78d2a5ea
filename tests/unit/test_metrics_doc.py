"""docs/METRICS.md documents every key a run writes: the keys of the metric functions callable
in-process (a whole learner step on the tiny model, every loss mode and type, the queue's counters,
the loop's summary) must each be a row of its tables, so a new metric without a row fails here.
tests/e2e/test_cli.py holds a real run's metrics.jsonl and summary.json to the same document."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any

import numpy as np
import pytest
import torch
from flat_settings import call_with_settings
from metrics_doc import METRICS_DOC, STEP_SECTION, SUMMARY_SECTION, documented_keys, section_keys, undocumented
from test_update_modes import groups

from asyncgrpo import algo
from asyncgrpo.config import load
from asyncgrpo.queue.dispatch import Dispatcher
from asyncgrpo.driver.evaluation import evaluate, probe_report
from asyncgrpo.driver.loop import Progress, note_lost_groups
from asyncgrpo.learner.learner import Learner
from asyncgrpo.learner.parts import outside_sections
from asyncgrpo.learner.policy import Policy
from asyncgrpo.models.tiny import TinyModelSpec, build_model
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.queue.registry import GeneratorRegistry
from asyncgrpo.queue.replay_queue import ReplayQueue, StalenessEviction
from asyncgrpo.rewards.errors import ErrorWindow
from asyncgrpo.rollout.stats import GeneratorStats
from asyncgrpo.wire import ScoredGroup

# The one template wide enough to cover any reward/ key: only the reward terms' own keys may use it.
REWARD_TERM_TEMPLATE = "reward/<term>"


@pytest.fixture(scope="module")
def doc() -> str:
    return METRICS_DOC.read_text()


@pytest.fixture(scope="module")
def step_docs(doc: str) -> set[str]:
    return section_keys(doc, STEP_SECTION)


def scored_groups(num_groups: int, samples: int = 4) -> list[ScoredGroup]:
    """test_update_modes' groups (rollout log-probs far from the tiny model's), each at its prompt's
    position and with a reward term in its meta as a generator's Scorer reports it."""
    return [dataclasses.replace(group, pos=g, meta={"reward/correct": 0.5, "reward/errors": 0})
            for g, group in enumerate(groups(num_groups, samples))]


def learner_after_one_step(*overrides: str) -> tuple[Learner, dict[str, float]]:
    """A learner rank 0 with the real queue, registry and update, in-process on the tiny model; the
    KL reference is a frozen copy of the starting weights (as Policy.from_config makes it)."""
    cfg = load(["learner.warmup_steps=0", "rollout.num_generators=1", "train.groups_per_step=2", *overrides])
    tokenizer = build_char_tokenizer()
    model = build_model(TinyModelSpec.from_config(cfg.model), tokenizer, seed=0)
    reference = copy.deepcopy(model).eval().requires_grad_(False) if cfg.algo.kl.enabled else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    policy = Policy(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), reference,
                    torch.device("cpu"), torch.device("cpu"), rank=0, temperature=cfg.rollout.temperature)
    registry = GeneratorRegistry(ErrorWindow.from_config(cfg.reward), ErrorWindow.from_config(cfg.env))
    queue = ReplayQueue(None, 8, StalenessEviction(cfg.train.max_staleness, drop_stale=True),
                        limits=None, registry=registry)
    for group in scored_groups(2):
        queue.put(group)
    learner = Learner(cfg, policy=policy, model_dir="", pad_id=tokenizer.pad_token_id, rank=0, world_size=1,
                      source=queue, registry=registry, weights=None, owns_process_group=False,
                      **outside_sections(cfg))
    try:
        return learner, learner.step()
    finally:
        queue.close()


def test_the_parser_takes_the_first_cell_of_each_table_row_by_section_and_matches_templates():
    text = "\n".join([
        "# Title", "| `not/in_a_section` | x | y |",
        "## metrics.jsonl", "### Some", "| key | meaning | watch |", "|---|---|---|",
        "| `a/b` | x | y |", "| `wire/rejected/<reason>` | x | y |", "| plain | no backticks |",
        "## `summary.json`", "### learner", "| `version` | x | y |",
    ])
    keys = documented_keys(text)
    assert keys == {"metrics.jsonl": {"Some": {"a/b", "wire/rejected/<reason>"}},
                    "summary.json": {"learner": {"version"}}}
    step = section_keys(text, "metrics.jsonl")
    assert undocumented(["a/b", "wire/rejected/too_long", "wire/rejected", "wire/rejected/a/b", "c"], step) == \
        ["c", "wire/rejected", "wire/rejected/a/b"]


def test_the_document_has_the_step_and_summary_sections_and_the_grpo_diagnostics(doc, step_docs):
    assert {"policy/entropy", "reward/all_equal_frac", "response/clipped_frac", "staleness/max"} <= step_docs
    assert {"status", "steps", "samples", "learner", "generators"} <= section_keys(doc, SUMMARY_SECTION, "Top level")


@pytest.mark.parametrize("overrides", [
    (),
    ("algo.kl.enabled=true",),
    ("algo.mode=decoupled", "algo.correction.is_level=sequence", "algo.correction.is_batch_normalize=true",
     "algo.correction.rs='token_k1,seq_max_k2'", "algo.correction.rs_threshold=5.0"),
    ("algo.mode=naive", "algo.loss_type=gspo"),
], ids=["bypass", "kl", "decoupled-is-rs", "naive-gspo"])
def test_every_key_of_a_learner_step_is_documented(overrides, step_docs):
    learner, metrics = learner_after_one_step(*overrides)
    # Only the reward terms' keys may fall under reward/<term>; a new batch statistic needs its row.
    terms = {"reward/correct"}
    assert terms <= metrics.keys()
    assert undocumented(metrics.keys() - terms, step_docs - {REWARD_TERM_TEMPLATE}) == []
    assert undocumented(terms, step_docs) == []
    if "algo.kl.enabled=true" in overrides:
        assert "loss/kl" in metrics


def test_the_learner_summary_is_documented(doc, step_docs):
    learner, _ = learner_after_one_step()
    summary = learner.summary()
    documented = section_keys(doc, SUMMARY_SECTION, "learner") | step_docs  # with the queue's final counters
    assert undocumented(summary.keys(), documented) == []


@pytest.mark.parametrize(("mode", "loss_type"), itertools.product(algo.MODES, algo.LOSS_TYPES))
@pytest.mark.parametrize("is_threshold", [2.0, "0.5_2.0"])
def test_every_loss_metric_of_every_mode_and_loss_type_is_documented(mode, loss_type, is_threshold, step_docs):
    generator = torch.Generator().manual_seed(0)
    shape = (3, 5)
    logp = -torch.rand(shape, generator=generator) - 0.1
    rollout = -torch.rand(shape, generator=generator) - 0.1
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] + [0.0] * 4])
    _, metrics = call_with_settings(
        algo.mode_policy_loss, logp.requires_grad_(), None if mode == "bypass" else logp.detach() + 0.05, rollout,
        torch.randn(shape, generator=generator) * mask, mask, mode=mode, loss_type=loss_type,
        clip_low=1.0 if loss_type == "cispo" else 0.2, clip_high=0.28, clip_c=3.0, agg="token-mean",
        norm_constant=None, is_level="token", is_threshold=is_threshold, is_batch_normalize=True,
        rs=",".join(algo.RS_OPTIONS), rs_threshold=10.0)
    assert any(key.startswith("mismatch/") for key in metrics)
    assert undocumented(metrics.keys(), step_docs - {REWARD_TERM_TEMPLATE}) == []


def test_the_queue_wire_and_dispatch_counters_are_documented(step_docs):
    queue = ReplayQueue(None, 8, StalenessEviction(2, drop_stale=True), limits=None,
                        dispatcher=Dispatcher(groups_per_step=2, max_staleness=2))
    try:
        queue.rejected.record_error("too_long", "a group longer than the model's context")
        stats = queue.stats()
    finally:
        queue.close()
    assert "wire/rejected/too_long" in stats and any(key.startswith("dispatch/") for key in stats)
    assert undocumented(stats.keys(), step_docs - {REWARD_TERM_TEMPLATE}) == []


class RecordingSink:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any], step: int | None = None) -> None:
        self.records.append(record)


class Evaluator:
    def on_evaluator(self, method: str, *args: Any, what: str) -> float:
        return 0.5


def test_the_evaluation_records_and_their_summary_entries_are_documented(doc, step_docs):
    sink = RecordingSink()
    entries = evaluate(Evaluator(), [], "end", step=3, metrics=sink)
    (record,) = sink.records
    periodic = {"step": 3, "eval/accuracy": 0.5, "eval/greedy_accuracy": 0.5, "eval/when": "periodic",
                "eval/seconds": 1.0}  # the keys of PeriodicEvaluations.evaluate's records
    assert undocumented(record.keys() | periodic.keys(), step_docs) == []
    assert undocumented(entries.keys(), section_keys(doc, SUMMARY_SECTION, "Top level")) == []


def test_the_training_loops_summary_is_documented(doc):
    progress = Progress.from_resume({"version": 2, "states": {"learner": {"samples": 16}}})
    progress.add([{"step": 3, "samples": 24, "reward/mean": 0.5, "staleness/max": 1, "reward/groups_dropped": 2,
                   "queue/dropped_stale": 0, "queue/received": 4, "queue/lost": 4}])
    summary = progress.summary({"version": 2, "states": {"queue": {"counters": {"queue/received": 1}}}})
    summary["generators"] = [{"reward/groups_dropped": 2}]
    assert note_lost_groups(summary, max_fraction=0.1) is not None  # the warning too
    top = section_keys(doc, SUMMARY_SECTION, "Top level")
    assert undocumented(summary.keys(), top) == []
    assert undocumented(summary["groups_lost"].keys(), section_keys(doc, SUMMARY_SECTION, "groups_lost")) == []


def test_a_generators_report_and_the_probe_are_documented(doc):
    stats = GeneratorStats()
    for phase in ("weights", "eval", "ask", "throttle", "exhausted", "rejoin", "generate", "score", "score_wait",
                  "send"):
        with stats.timer(phase):
            pass
    report = {**stats.as_dict(max_running_seqs=256), "restarts": 0}
    assert undocumented(report.keys(), section_keys(doc, SUMMARY_SECTION, "generators[]")) == []
    probe = probe_report([np.zeros(2)], [np.zeros(2)], [np.ones(2)], generator_version=1, learner_version=1)
    assert undocumented(probe.keys(), section_keys(doc, SUMMARY_SECTION, "probe")) == []
