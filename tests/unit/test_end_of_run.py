"""The generators after the last learner step (driver/actors.py): a generator whose process dies
then is not restarted and does not fail the run; the final evaluations and the probe use another
generator, or a fresh engine started from the learner's final weights. Fake actors and refs
stand in for Ray's; `get` and `ray.kill` are replaced by their in-process equivalents."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ray.exceptions import RayActorError

from asyncgrpo.config import load
from asyncgrpo.driver import TrainingFailed
from asyncgrpo.driver import actors as actors_module
from asyncgrpo.driver.actors import Actors
from asyncgrpo.rollout.spec import GeneratorSpec


class Ref:
    """A finished remote call: its value, or the error `ray.get` raises for it."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class Method:
    def __init__(self, generator: FakeGenerator, name: str) -> None:
        self.generator, self.name = generator, name

    def remote(self, *args: Any) -> Ref:
        self.generator.calls.append((self.name, args))
        if self.generator.dead or self.name in self.generator.dies_on:
            self.generator.dead = True
            return Ref(error=RayActorError())
        return Ref(value=self.generator.answers.get(self.name))


class FakeGenerator:
    def __init__(self, name: str, answers: dict[str, Any] | None = None, dead: bool = False,
                 dies_on: tuple[str, ...] = ()) -> None:
        self.name, self.dead, self.dies_on = name, dead, dies_on
        self.answers = {"ready": {"pid": 1}, **(answers or {})}
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, method: str) -> Method:
        return Method(self, method)


def fake_get(refs: Any, timeout_s: float, what: str) -> Any:
    return [ref.result() for ref in refs] if isinstance(refs, list) else refs.result()


@pytest.fixture
def ended_run(tmp_path, monkeypatch):
    """`make(generators)`: an `Actors` whose training has ended at version 40, its generators
    these fakes; `.killed` lists the handles `ray.kill` was called on, `.exports` the learner's exports."""
    import ray

    killed: list[Any] = []
    monkeypatch.setattr(actors_module, "get", fake_get)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: killed.append(actor))

    def make(generators: list[FakeGenerator], fresh: FakeGenerator | None = None) -> Actors:
        cfg = load(overrides=[f"rollout.num_generators={len(generators)}", f"run_dir={tmp_path / 'run'}"])
        actors = Actors(cfg, model_dir=str(tmp_path / "model"))
        actors.generators = list(generators)
        endpoints = {"groups": "tcp://127.0.0.1:1", "weights": "tcp://127.0.0.1:2", "tickets": "tcp://127.0.0.1:3"}
        actors.specs = [GeneratorSpec.for_run(cfg, i, actors.model_dir, endpoints, cfg.train.groups_per_step)
                       for i in range(len(generators))]
        actors.killed, actors.exports, actors.started = killed, [], []

        def on_all_ranks(method: str, *args: Any, timeout_s: float, all_results: bool = False) -> Any:
            assert method == "export_hf"
            Path(args[0]).mkdir(parents=True)
            actors.exports.append(args[0])
            return args[0]

        def start_generator(spec: GeneratorSpec) -> FakeGenerator:
            actors.started.append(spec)
            assert fresh is not None, "no fresh generator expected"
            return fresh

        monkeypatch.setattr(actors, "on_all_ranks", on_all_ranks)
        monkeypatch.setattr(actors, "_start_generator", start_generator)
        return actors

    return make


def runs_of(*outcomes: Any) -> list[Ref]:
    """A `run()` ref per generator: a report, or an error."""
    return [Ref(error=o) if isinstance(o, BaseException) else Ref(value=o) for o in outcomes]


def test_a_generator_dead_after_the_last_step_is_reported_and_the_evaluations_use_the_next_one_alive(ended_run):
    dead = FakeGenerator("g0", dead=True)
    alive = FakeGenerator("g1", answers={"evaluate": 0.75, "loaded_version": 40})
    actors = ended_run([dead, alive])
    actors.restarts = [2, 0]

    reports = actors.generator_reports(runs_of(RayActorError(), {"gen/groups_sent": 9}), final_version=40)

    assert reports[0]["restarts"] == 2 and "RayActorError" in reports[0]["died_after_training"]
    assert reports[1] == {"gen/groups_sent": 9, "restarts": 0}
    assert actors.killed == [dead]  # its Ray CPUs are freed
    assert actors.on_evaluator("evaluate", ["problem"], 1.0, what="evaluate, end") == 0.75
    assert actors.on_evaluator("loaded_version", what="loaded_version") == 40
    assert dead.calls == [] and [name for name, _ in alive.calls] == ["evaluate", "loaded_version"]
    assert actors.exports == []  # no fresh engine while one is alive


def test_with_every_generator_dead_the_evaluations_run_on_a_fresh_engine_started_from_the_final_weights(ended_run):
    fresh = FakeGenerator("fresh", answers={"evaluate": 0.5, "loaded_version": 40})
    actors = ended_run([FakeGenerator("g0", dead=True)], fresh=fresh)
    actors.restarts = [1]
    actors.generator_reports(runs_of(RayActorError()), final_version=40)

    assert actors.on_evaluator("evaluate", ["problem"], 0.0, what="greedy evaluate, end") == 0.5
    weights_dir = Path(actors.cfg.run_dir).resolve() / "evaluator_weights"
    assert actors.exports == [str(weights_dir)]
    (start,) = actors.started
    # A new incarnation: its groups could never pass for its predecessor's.
    assert (start.generator_id, start.incarnation) == (0, 2)
    assert start.model_dir == str(weights_dir) and start.initial_version == 40
    assert actors.on_evaluator("loaded_version", what="loaded_version") == 40
    assert len(actors.exports) == 1  # started once, then reused
    actors.stop()
    assert not weights_dir.exists()  # the exported weights go with the run's actors


def test_a_generator_dying_during_the_final_evaluation_is_replaced_once_then_the_run_fails(ended_run):
    first = FakeGenerator("g0", dies_on=("evaluate",))
    second = FakeGenerator("g1", answers={"evaluate": 0.25})
    actors = ended_run([first, second])
    actors.generator_reports(runs_of({}, {}), final_version=3)
    assert actors.on_evaluator("evaluate", [], 1.0, what="evaluate, end") == 0.25

    actors = ended_run([FakeGenerator("g0", dies_on=("evaluate",)), FakeGenerator("g1", dies_on=("evaluate",))])
    actors.generator_reports(runs_of({}, {}), final_version=3)
    with pytest.raises(TrainingFailed, match="generator 1 died during the evaluate, end at the end of the run"):
        actors.on_evaluator("evaluate", [], 1.0, what="evaluate, end")


def test_a_generator_whose_run_raised_still_fails_the_run_at_its_end(ended_run):
    actors = ended_run([FakeGenerator("g0")])
    with pytest.raises(ValueError, match="its own error"):
        actors.generator_reports(runs_of(ValueError("its own error")), final_version=3)
    assert actors.killed == [] and actors.dead_after_training == set()


# ---------------------------------------------------------------------------------------------
# Lost groups: a run that finished but lost more than train.max_lost_fraction of the groups its
# generators made (rejected at the learner, lost on the wire, dropped for reward errors) says so.

# The issue's run: 320 groups made, 224 of them with a reward of 1e39 rejected by the learner's
# decoder (wire/rejected/bad_rewards), each a gap in its generator's sequence (queue/lost).
ISSUE_QUEUE = {"queue/received": 96, "queue/consumed": 96, "queue/lost": 224, "wire/rejected": 224,
               "wire/rejected/bad_rewards": 224}


def finished_train(tmp_path, monkeypatch, filled: dict[str, Any], *overrides: str) -> dict[str, Any]:
    """train() with every phase replaced: `_run_actors` leaves `filled` in the summary."""
    from asyncgrpo import train as train_module

    def run_actors(cfg, model_dir, metrics, summary, resume):
        summary.update(filled)

    for name, value in {"resolve_device": lambda device: "cpu", "check_rewards": lambda cfg: {},
                        "resume_point": lambda cfg: None, "starting_model": lambda cfg, resume, summary: "model",
                        "preflight": lambda cfg, model_dir: {}, "start_ray": lambda cfg: False,
                        "_run_actors": run_actors}.items():
        monkeypatch.setattr(train_module, name, value)
    return train_module.train(load(overrides=[f"run_dir={tmp_path / 'run'}", "progress=false", *overrides]))


def test_a_finished_run_that_lost_most_of_its_groups_says_so_in_its_summary(tmp_path, monkeypatch, capsys):
    import json

    filled = {"steps": 6, "queue": ISSUE_QUEUE, "generators": [{"reward/groups_dropped": 0, "restarts": 0}]}
    summary = finished_train(tmp_path, monkeypatch, filled)
    assert summary["status"] == "finished"  # it did finish; what it trained on is the warning's point
    assert summary["groups_lost"] == {"made": 320, "lost": 224, "fraction": 0.7, "rejected_untrainable": 0,
                                      "lost_on_the_wire": 224, "dropped_for_reward_errors": 0}
    warning = summary["warning"]
    assert "\n" not in warning and "224 of 320 groups" in warning and "train.max_lost_fraction=0.05" in warning
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["warning"] == warning
    assert f"[warning] {warning}" in capsys.readouterr().out.splitlines()


@pytest.mark.parametrize(("lost", "warned"), [(0, False), (5, False), (6, True)])
def test_a_run_warns_only_beyond_max_lost_fraction(tmp_path, monkeypatch, lost, warned):
    queue = {"queue/received": 100 - lost, "queue/lost": lost, "wire/rejected": 0}
    summary = finished_train(tmp_path, monkeypatch, {"queue": queue, "generators": []})
    assert summary["status"] == "finished" and ("warning" in summary) == warned
    assert summary["groups_lost"]["lost"] == lost and summary["groups_lost"]["made"] == 100


def test_max_lost_fraction_one_never_warns(tmp_path, monkeypatch):
    summary = finished_train(tmp_path, monkeypatch, {"queue": ISSUE_QUEUE}, "train.max_lost_fraction=1")
    assert summary["status"] == "finished" and "warning" not in summary and summary["groups_lost"]["lost"] == 224


def test_a_run_that_made_no_groups_has_nothing_lost(tmp_path, monkeypatch):
    summary = finished_train(tmp_path, monkeypatch, {"steps": 0})
    assert summary["groups_lost"]["made"] == 0 and summary["groups_lost"]["fraction"] == 0.0
    assert "warning" not in summary


def test_lost_groups_count_untrainable_rejections_gaps_and_reward_drops_once_each():
    from asyncgrpo.driver.loop import lost_groups

    # 3 frames the decoder rejected are gaps (in queue/lost as well as wire/rejected); 2 groups the
    # model cannot train on are rejections that are no gap; a generator's Heartbeat rejected is no group.
    queue = {"queue/received": 88, "queue/lost": 3, "wire/rejected": 6, "wire/rejected/bad_rewards": 3,
             "wire/rejected/too_long": 1, "wire/rejected/token_out_of_vocab": 1, "wire/rejected/bad_header": 1}
    generators = [{"reward/groups_dropped": 4}, {"died_after_training": "RayActorError", "restarts": 0},
                  {"reward/groups_dropped": 1}]
    lost = lost_groups({"queue": queue, "generators": generators, "reward_groups_dropped": 2})
    assert (lost.rejected_untrainable, lost.lost_on_the_wire, lost.dropped_for_reward_errors) == (2, 3, 5)
    assert lost.made == 88 + 2 + 3 + 5 and lost.lost == 10
    # The steps' reports outnumber the generators' own (a restarted generator counts afresh).
    more = lost_groups({"queue": queue, "generators": generators, "reward_groups_dropped": 9})
    assert more.dropped_for_reward_errors == 9


def test_every_reason_the_learner_finds_a_group_untrainable_counts_as_lost():
    import numpy as np

    from asyncgrpo.driver.loop import UNTRAINABLE_REASONS
    from asyncgrpo.queue.replay_queue import GroupLimits
    from asyncgrpo.wire import ScoredGroup

    def group(prompt: int = 2, lengths: tuple[int, ...] = (2, 2), token: int = 1) -> ScoredGroup:
        tokens = np.full(sum(lengths), token, np.int32)
        return ScoredGroup(generator_id=0, seq=0, prompt_id=1, prompt_tokens=np.ones(prompt, np.int32), tokens=tokens,
                           logprobs=np.zeros(tokens.size, np.float32), versions=np.zeros(tokens.size, np.int32),
                           lengths=np.asarray(lengths, np.int32), rewards=np.zeros(len(lengths), np.float32))

    limits = GroupLimits(vocab_size=10, max_positions=8, max_samples=2)
    assert limits.untrainable(group()) is None
    reasons = {limits.untrainable(g)[0] for g in (group(prompt=0), group(lengths=(1, 1, 1)), group(lengths=(9, 1)),
                                                   group(token=10))}
    assert reasons == {"empty_prompt", "too_many_samples", "too_long", "token_out_of_vocab"} == set(UNTRAINABLE_REASONS)


def test_the_loop_totals_the_groups_dropped_for_reward_errors_over_its_steps(tmp_path):
    from asyncgrpo.driver.loop import run_loop
    from asyncgrpo.metrics import SampleLogger

    class Learner:
        step = 0

        def train_steps(self, k: int) -> list[dict[str, float]]:
            records = []
            for _ in range(k):
                self.step += 1
                records.append({"step": self.step, "samples": 8 * self.step, "reward/mean": 0.0, "staleness/max": 0,
                                "queue/dropped_stale": 0, "reward/groups_dropped": self.step % 2})
            return records

    class Sink:
        def write(self, record: dict[str, Any], step: int | None = None) -> None:
            pass

    cfg = load(overrides=[f"run_dir={tmp_path}", "progress=false", "train.max_steps=5", "log.samples_every_steps=0"])
    summary: dict[str, Any] = {}
    run_loop(cfg, Learner(), Sink(), SampleLogger(tmp_path, lambda ids: ""), summary)
    assert summary["reward_groups_dropped"] == 3  # steps 1, 3, 5


@pytest.mark.parametrize("value", ["-0.1", "1.5", "nan"])
def test_a_max_lost_fraction_outside_zero_to_one_is_a_config_error(value):
    from asyncgrpo.schema import ConfigError

    with pytest.raises(ConfigError, match="train.max_lost_fraction"):
        load(overrides=[f"train.max_lost_fraction={value}"])
