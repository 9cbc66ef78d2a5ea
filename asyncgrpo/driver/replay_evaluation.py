"""Held-out evaluation of a replay's weights (`asyncgrpo replay`), so corrections replayed on the same
recording can be compared on accuracy, not only on losses.

A live run evaluates on a generator: vLLM holding pushed weights, `rollout.evaluations.held_out_accuracy`
on the task's held-out problems, sampled (temperature 1) and greedy. A replay has no generator, so it
starts one vLLM engine in its own process (on the replay's starting model, the first time an
evaluation is due) and, before each evaluation, copies the learner's current weights into it
(`Policy.full_state_dict`, the tensors a push carries, merged under LoRA) with the engine's own
`load_weights`: no socket, no serialisation. The same keys switch it as in a live run: eval.at_start
(the starting weights), eval.at_end (the final ones) and eval.every_steps (every learner version at
a multiple); the records and summary entries are the live run's (eval/accuracy,
eval/greedy_accuracy, eval/when; eval_accuracy_start/end, eval_greedy_accuracy_start/end).

The engine is reseeded with the run's seed before each evaluation: replays of one recording under
different corrections draw their sampled evaluations from the same random streams, which pairs them
more tightly still.

Threads: vLLM's CPU worker binds torch's OpenMP threads to the process's cores when it starts and
replaces `torch.set_num_threads` with a no-op for the rest of the process. The learner's thread count
(learner.torch_threads) fixes its reduction order, so the evaluator keeps torch's own
`set_num_threads` and switches: vLLM's count while it evaluates, the learner's otherwise. The
replay's losses are then the same whether and when it evaluates (tests/e2e/test_record_replay.py).
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.metrics import MetricsSink
from asyncgrpo.rollout.evaluations import (PeriodicEvaluations, held_out_accuracy, periodic_eval_line,
                                           write_evaluation)
from asyncgrpo.schema import Config


def evaluates(cfg: Config) -> bool:
    """Whether a replay with `cfg` evaluates at all (else it starts no engine)."""
    return bool(cfg.eval.at_start or cfg.eval.at_end or cfg.eval.every_steps)


class ReplayEvaluator:
    """vLLM in this process on `model_dir`, evaluating the weights of the learner it is given."""

    def __init__(self, cfg: Config, model_dir: str, start_version: int) -> None:
        import torch
        from transformers import AutoTokenizer

        # torch's own, before vLLM replaces it (see the module's docstring).
        self._set_threads = torch.set_num_threads
        self._learner_threads = torch.get_num_threads()
        self._engine_threads = self._learner_threads  # vLLM's, once it has started

        from asyncgrpo.envs import make_environment
        from asyncgrpo.composition import run_task

        self.cfg, self.model_dir = cfg, model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.task = run_task(cfg, self.tokenizer)
        self.env = make_environment(cfg.env)
        self.periodic = PeriodicEvaluations(cfg.eval.every_steps, start_version, self.task)
        self._problems: list[Any] | None = None
        self._engine: Any = None  # started by the first evaluation

    @property
    def problems(self) -> list[Any]:
        if self._problems is None:
            self._problems = self.task.eval_problems()
        return self._problems

    def evaluate(self, learner: Any, when: str, step: int, metrics: MetricsSink) -> dict[str, float]:
        """Sampled and greedy accuracy of the learner's current weights, written to `metrics` as the
        driver writes a start or end evaluation; returns the summary entries."""
        self._load(learner)
        return write_evaluation(metrics, when, step, self._accuracy(1.0), self._accuracy(0.0))

    def after_step(self, learner: Any, metrics: MetricsSink) -> None:
        """A periodic evaluation (eval.every_steps) when the learner's version is due for one."""
        if not self.periodic.due(learner.version):
            return
        self._load(learner)
        self.periodic.evaluate(learner.version, lambda problems, temperature: self._accuracy(temperature))
        for record in self.periodic.take():
            metrics.write(record)
            print(periodic_eval_line(record), flush=True)

    def _accuracy(self, temperature: float) -> float:
        from asyncgrpo.rollout.parts import episode_settings  # with torch: only where an engine evaluates

        self._set_threads(self._engine_threads)
        try:
            self._engine.reseed(self.cfg.seed)
            return held_out_accuracy(self._engine, self.tokenizer, self.task, self.env, episode_settings(self.cfg),
                                     self.problems, temperature)
        finally:
            self._set_threads(self._learner_threads)

    def _load(self, learner: Any) -> None:
        """The learner's current weights into the engine (started here the first time)."""
        import torch

        if self._engine is None:
            try:
                self._engine = self._start_engine()
                self._engine_threads = torch.get_num_threads()
            finally:
                self._set_threads(self._learner_threads)
        self._engine.load_weights(list(learner.policy.full_state_dict()))

    def _start_engine(self) -> Any:
        from asyncgrpo.rollout.engine import VLLMEngine

        r = self.cfg.rollout
        # Weights change only between evaluations, with nothing running: prefix caching is safe
        # (load_weights resets the cache).
        return VLLMEngine(self.model_dir, seed=self.cfg.seed, max_model_len=self.cfg.model.max_positions,
                          dtype=r.dtype, kv_cache_gib=r.kv_cache_gib, gpu_memory_utilization=r.gpu_memory_utilization,
                          max_running_seqs=r.max_running_seqs, prefix_caching=True)

    def close(self) -> None:
        """Shut vLLM down now, before the learner leaves its process group: vLLM's shutdown destroys
        the groups it made, which fails (at exit) once the learner has destroyed the default group."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.llm.llm_engine.engine_core.shutdown()
