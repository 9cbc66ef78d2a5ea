"""Held-out accuracy (at the start and the end of a run) and the probes: log-probs of fixed
sequences under vLLM at the start (generator 0) and the end (a generator holding the final weights,
`Actors.on_evaluator`), and under the learner at the end."""

from __future__ import annotations

from typing import Any

from asyncgrpo.composition import learner_wait_timeout_s
from asyncgrpo.driver import TrainingFailed
from asyncgrpo.driver.actors import Actors
from asyncgrpo.driver.remote import get
from asyncgrpo.metrics import MetricsSink
from asyncgrpo.rollout.evaluations import write_evaluation
from asyncgrpo.tasks import Problem


def evaluate(actors: Actors, problems: list[Problem], when: str, step: int, metrics: MetricsSink) -> dict[str, float]:
    """Accuracy on `problems`, sampled (temperature 1) and greedy, of generator 0 at the start and of
    a generator holding the final weights at the end (`Actors.on_evaluator`); written to `metrics`,
    printed, and returned as summary entries."""
    sampled = on_generator(actors, when, "evaluate", problems, 1.0, what=f"evaluate, {when}")
    greedy = on_generator(actors, when, "evaluate", problems, 0.0, what=f"greedy evaluate, {when}")
    return write_evaluation(metrics, when, step, sampled, greedy)


def on_generator(actors: Actors, when: str, method: str, *args: Any, what: str) -> Any:
    """Generator 0's answer at the start; at the end, that of one holding the final weights, which
    a generator's death after the last step does not prevent."""
    if when == "end":
        return actors.on_evaluator(method, *args, what=what)
    return get(getattr(actors.generators[0], method).remote(*args), actors.cfg.wire.timeout_s, f"generator 0 ({what})")


def probe_sequences(problems: list[Problem], tokenizer_dir: str, count: int = 4) -> list[list[int]]:
    """Fixed prompt+answer sequences on which generator and learner log-probs are compared."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [tokenizer(p.prompt + p.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            for p in problems[:count]]


class Probes:
    """The probe sequences and generator 0's log-probs of them at the start of the run."""

    def __init__(self, sequences: list[list[int]], start_logp: list[Any]) -> None:
        self.sequences, self.start_logp = sequences, start_logp

    @classmethod
    def at_start(cls, actors: Actors, problems: list[Problem], tokenizer_dir: str) -> Probes:
        sequences = probe_sequences(problems, tokenizer_dir)
        start_logp = get(actors.generators[0].sequence_logprobs.remote(sequences), actors.cfg.wire.timeout_s,
                         "generator 0 (sequence_logprobs, start)")
        return cls(sequences, start_logp)

    def compare(self, actors: Actors, learner_version: int) -> dict[str, Any]:
        """Generator (vLLM) and learner log-probs of the sequences at the final version."""
        generator_logp = actors.on_evaluator("sequence_logprobs", self.sequences, what="sequence_logprobs, end")
        learner_logp = actors.on_all_ranks("sequence_logprobs", self.sequences,
                                           timeout_s=learner_wait_timeout_s(actors.cfg))
        generator_version = actors.on_evaluator("loaded_version", what="loaded_version")
        return probe_report(generator_logp, learner_logp, self.start_logp, generator_version, learner_version)


def check_probe(report: dict[str, Any], tolerance: float) -> None:
    """Fail the run when vLLM's log-probs are not the learner's: pushed weights went astray."""
    gap = report["max_abs_diff_vs_learner"]
    if not gap <= tolerance:  # NaN fails too
        raise TrainingFailed(
            f"the generators' log-probs differ from the learner's by up to {gap:.3g} per token at version "
            f"{report['learner_version']} (train.probe_tolerance={tolerance:g}): the weights vLLM samples with "
            f"are not the learner's (generator at version {report['generator_version']})")


def probe_report(generator_logp: list[Any], learner_logp: list[Any], start_logp: list[Any],
                 generator_version: int, learner_version: int) -> dict[str, Any]:
    """The largest per-token log-prob gaps: generator vs learner now, generator now vs at the start."""
    import numpy as np

    return {
        "generator_version": generator_version,
        "learner_version": learner_version,
        "max_abs_diff_vs_learner": max(float(np.abs(g - l).max()) for g, l in zip(generator_logp, learner_logp)),
        "max_abs_change_since_start": max(float(np.abs(g - s).max()) for g, s in zip(generator_logp, start_logp)),
    }
