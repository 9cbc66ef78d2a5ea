"""A generator's spec (rollout/spec.py): built from the run's config, it carries what the generator
needs to start; its restarts and the evaluator at the end of a run differ from it only in their
incarnation and starting weights; it survives the pickling that Ray's actor arguments go through."""

from __future__ import annotations

import dataclasses
import pickle

from asyncgrpo.config import load
from asyncgrpo.rollout.spec import GeneratorSpec
from asyncgrpo.wire import WireKeys

ENDPOINTS = {"groups": "tcp://127.0.0.1:5001", "weights": "tcp://127.0.0.1:5002", "tickets": "tcp://127.0.0.1:5003"}


def first_spec(*overrides: str, generator_id: int = 1) -> GeneratorSpec:
    cfg = load(overrides=["rollout.num_generators=2", "train.groups_per_step=5", "seed=3", *overrides])
    keys = WireKeys.generate(2)
    return GeneratorSpec.for_run(cfg, generator_id, "/models/start", ENDPOINTS, cfg.train.groups_per_step, cores=[4, 5],
                                 curve=keys.client(generator_id), initial_version=7)


def test_a_spec_built_from_the_config_carries_what_the_generator_needs():
    spec = first_spec()
    assert (spec.generator_id, spec.model_dir, spec.initial_version, spec.incarnation) == (1, "/models/start", 7, 0)
    assert (spec.groups_endpoint, spec.weights_endpoint, spec.tickets_endpoint) == (
        ENDPOINTS["groups"], ENDPOINTS["weights"], ENDPOINTS["tickets"])
    assert spec.groups_per_call == 2  # 5 groups a step over 2 generators: 3 and 2
    assert first_spec(generator_id=0).groups_per_call == 3
    assert first_spec("rollout.groups_per_call=4").groups_per_call == 4
    assert spec.seed == 3 * 1000 + 1 != first_spec(generator_id=0).seed  # no two generators sample alike
    assert spec.cores == (4, 5) and spec.curve is not None


def test_a_restarted_generators_spec_differs_from_the_first_only_in_its_incarnation():
    first = first_spec()
    restarted = first.restarted(incarnation=2)
    assert restarted.incarnation == 2
    assert dataclasses.replace(restarted, incarnation=0) == first


def test_the_evaluators_spec_differs_from_the_first_only_in_its_weights_and_incarnation():
    first = first_spec()
    evaluator = first.starting_from("/run/evaluator_weights", 40, incarnation=1)
    assert (evaluator.model_dir, evaluator.initial_version, evaluator.incarnation) == ("/run/evaluator_weights", 40, 1)
    assert dataclasses.replace(evaluator, model_dir=first.model_dir, initial_version=7, incarnation=0) == first


def test_a_spec_survives_pickling_as_ray_passes_it_to_the_actor():
    spec = first_spec()
    assert pickle.loads(pickle.dumps(spec)) == spec
