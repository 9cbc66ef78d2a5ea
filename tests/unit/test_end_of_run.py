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
        actors.killed, actors.exports, actors.started = killed, [], []

        def on_all_ranks(method: str, *args: Any, timeout_s: float, all_results: bool = False) -> Any:
            assert method == "export_hf"
            Path(args[0]).mkdir(parents=True)
            actors.exports.append(args[0])
            return args[0]

        def start_generator(index: int, skip_problems: int = 0, incarnation: int = 0) -> FakeGenerator:
            actors.started.append((index, incarnation, dict(actors._generator_start)))
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
    ((index, incarnation, start),) = actors.started
    assert (index, incarnation) == (0, 2)  # a new incarnation: its groups could never pass for its predecessor's
    assert start["model_dir"] == str(weights_dir) and start["initial_version"] == 40
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
