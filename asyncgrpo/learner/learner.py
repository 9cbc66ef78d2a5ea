"""A learner rank: take groups, update the policy, push the new weights.

    step():  ack_wait -> gen_wait (take) -> record -> prepare -> train (update) -> push

(Under train.fixed_staleness=k >= 1 the push after the update only keeps a copy of the new
version; the one that fills the next step is sent right after the take, timed as `push` too, so
the generators sample the next step while this one trains: learner/publication.py.)

Rank 0's first phases wait for lagging engines and take the step's groups through `intake.GroupIntake`,
which also keeps publishing the newest weights to a restarted generator until it loads them.

Rank 0 owns the group source (the replay queue), the generator registry, the weight sender and,
with `wire.record_dir`, the stream recorder; the other ranks receive rank 0's batch and join every
collective. Plain Python: `from_config` builds the real parts, tests pass fakes (a `ListSource`, no
weight sender), `asyncgrpo replay` a `RecordedSource`, and `actor.LearnerActor` runs it as a Ray actor.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from asyncgrpo import contract
from asyncgrpo.learner.admission import AdmissionControl
from asyncgrpo.learner import checkpoint
from asyncgrpo.learner import lora
from asyncgrpo.learner.batch import Batch, broadcast_batch, collate
from asyncgrpo.learner.intake import GroupIntake
from asyncgrpo.learner.metrics import arrived_all_equal_fraction, batch_metrics, rate_metrics
from asyncgrpo.learner.parts import learner_parts
from asyncgrpo.learner.policy import Policy
from asyncgrpo.learner.publication import VersionPublisher, VersionRing
from asyncgrpo.learner.update import update
from asyncgrpo.runtime.memory import peak_memory
from asyncgrpo.metrics.samples import sample_records
from asyncgrpo.recording.recorder import StreamRecorder
from asyncgrpo.queue.registry import GeneratorRegistry
from asyncgrpo.queue.sources import GroupSource
from asyncgrpo.rewards.metrics import reward_term_metrics
from asyncgrpo.schema import Config
from asyncgrpo.runtime.timing import PhaseTimer
from asyncgrpo.weights import Publication
from asyncgrpo.weights.base import WeightSender
from asyncgrpo.wire import SaveNotice, ScoredGroup


class Learner:
    def __init__(self, cfg: Config, policy: Policy, model_dir: str, pad_id: int, *, rank: int, world_size: int,
                 source: GroupSource | None, registry: GeneratorRegistry | None, weights: WeightSender | None,
                 owns_process_group: bool, max_new_tokens: int, publication: Publication, num_generators: int,
                 timeout_s: float, recorder: StreamRecorder | None = None, ring: VersionRing | None = None,
                 run_record: Callable[[], dict[str, Any]] | None = None) -> None:
        """Rank 0's `source`, `registry`, `weights`, `recorder` (None elsewhere; None: no pushes, nothing recorded);
        from other sections, by `parts`: `max_new_tokens`, `publication`, `num_generators`, `timeout_s`
        (wire.timeout_s), `ring` (None: off), `run_record` (None: not recorded)."""
        self.cfg, self.policy, self.model_dir, self.pad_id = cfg, policy, model_dir, pad_id
        self.rank, self.world_size = rank, world_size
        self.source, self.weights, self.recorder = source, weights, recorder
        self._owns_process_group = owns_process_group
        self.version, self.samples_consumed = 0, 0
        self.staleness_histogram: dict[int, int] = {}
        self.ack_waits, self.idle_s = 0, 0.0
        self._first_step_start, self._busy_until = 0.0, 0.0
        self._last_taken: tuple[int, list[ScoredGroup]] = (0, [])
        self._filtered_seen = 0  # the source's queue/filtered at the end of the last step
        self._run_record: dict[str, Any] | None = None
        self._make_run_record = run_record
        self._adapter_record: dict[str, Any] | None = None
        self._save_started: float | None = None  # time.monotonic() at the start of the save under way
        self.max_new_tokens = max_new_tokens
        # train.fixed_staleness=k >= 1 (`ring`): versions published late, after each take.
        self.publisher = VersionPublisher(policy, weights, publication, ring)
        self.intake = (GroupIntake(cfg, source, registry, weights, publication=publication, num_generators=num_generators,
                                   timeout_s=timeout_s) if source is not None else None)
        self.admission = AdmissionControl(cfg, source)  # train.staleness_control=divergence's bound, the cap's count

    @classmethod
    def from_config(cls, cfg: Config, model_dir: str, rank: int = 0, world_size: int = 1, **where: Any) -> Learner:
        """The real parts (see `parts.learner_parts` for `where`: master address/port, cores, CURVE keys)."""
        return cls(**learner_parts(cfg, model_dir, rank, world_size, **where).arguments)

    # ------------------------------------------------------------------------------- the loop

    def train_steps(self, num_steps: int) -> list[dict[str, float]]:
        """`num_steps` steps, with a checkpoint every `train.save_every_steps`; every rank calls it."""
        records = []
        for _ in range(num_steps):
            metrics = self.step()
            every = self.cfg.train.save_every_steps
            if every and self.version % every == 0:
                start = time.perf_counter()
                self.save_checkpoint(Path(self.cfg.run_dir) / "checkpoints")
                metrics["time/checkpoint_s"] = time.perf_counter() - start
            records.append(metrics)
        return records

    def step(self) -> dict[str, float]:
        """One step: rank 0's `ack_wait`, `gen_wait` (and, under fixed staleness, `push`) and
        `record`, then every rank's `prepare`, `train` and `push`, each timed; only rank 0's metrics carry the queue's and the generators'
        numbers."""
        timer = PhaseTimer()
        start = time.perf_counter()
        self._first_step_start = self._first_step_start or start
        groups = self._take_groups(timer) if self.rank == 0 else None
        metrics = self.train_on(groups, timer)
        if self.intake is not None:
            self.intake.rejoins.serve()
        self.idle_s += timer.seconds["ack_wait"] + timer.seconds["gen_wait"]
        self._busy_until = time.perf_counter()
        metrics.update(rate_metrics(metrics, self._busy_until - start))
        metrics.update({"learner/ack_waits": self.ack_waits, **timer.metrics()})
        if self.rank == 0:
            metrics.update(self.intake.generator_metrics(self.publisher.pushed_version))
            metrics.update(self.source.stats())
            self._filtered_seen, metrics["reward/all_equal_frac_arrived"] = arrived_all_equal_fraction(
                metrics, self._filtered_seen, len(self._last_taken[1]))
        return metrics

    def _take_groups(self, timer: PhaseTimer) -> list[ScoredGroup]:
        """Rank 0's phases before training: wait for lagging engines, take the step's groups, publish
        what fills the next step (fixed staleness), record them."""
        with timer("ack_wait"):
            self._wait_for_generators()
        with timer("gen_wait"):
            groups = self.intake.take(self.version)
        with timer("push"):  # under train.fixed_staleness: the version that fills the next step
            self.publisher.after_take(self.version)
        if self.recorder is not None:
            with timer("record"):  # before training: the version is the one that took them
                self.recorder.record_step(self.version, groups)
        self._last_taken = (self.version, groups)
        return groups

    def _wait_for_generators(self) -> None:
        """The `ack_wait` phase; a wait counts in `learner/ack_waits`."""
        if self.intake.wait_for_generators(self.version):
            self.ack_waits += 1

    def train_on(self, groups: list[ScoredGroup] | None, timer: PhaseTimer | None = None) -> dict[str, float]:
        """Prepare, update and push on `groups` (rank 0's; the other ranks pass None and receive them)."""
        timer = timer or PhaseTimer()
        with timer("prepare"):
            batch = self._prepare(groups)
        with timer("train"):
            metrics = update(self.policy, batch, self.cfg, self.rank, self.world_size,
                             max_new_tokens=self.max_new_tokens, version=self.version)
        metrics.update(self.admission.after_step(metrics))  # the bound for the grants from now on
        staleness = contract.staleness(batch.group_version_min, self.version)
        self.version += 1
        with timer("push"):
            metrics.update(self.publisher.after_update(self.version))
        self.samples_consumed += batch.num_samples
        for value in staleness.tolist():
            self.staleness_histogram[value] = self.staleness_histogram.get(value, 0) + 1
        metrics.update(batch_metrics(batch, staleness, self.version, self.samples_consumed, self.max_new_tokens))
        if groups is not None:
            metrics.update(reward_term_metrics(groups))
        return metrics

    def _prepare(self, groups: list[ScoredGroup] | None) -> Batch:
        batch = collate(groups, self.pad_id) if self.rank == 0 else None
        if self.world_size > 1:
            return broadcast_batch(batch, self.policy.device)
        return batch.to(self.policy.device)

    # ------------------------------------------------------------------------------- weights

    def push_weights(self) -> int:
        """Push the current weights now (every rank calls it); returns the bytes sent."""
        return self.publisher.push(self.version)

    # ------------------------------------------------------------------------------- restarts
    # The driver calls these three on rank 0 from the actor's control group, i.e. on another
    # thread while a step runs: they touch only the queue, the registry and the intake's rejoins (all
    # locked), and leave publishing to the step's thread (a ZeroMQ socket belongs to one thread).

    def generator_down(self, generator_id: int) -> None:
        """Rank 0: the generator's process died and the driver is restarting it: its slots not
        arrived go to the next asker, and nothing waits for its acknowledgements or times out meanwhile."""
        self.source.generator_down(generator_id)

    def generator_rejoined(self, generator_id: int, incarnation: int) -> dict[str, Any]:
        """Rank 0: the restarted generator is up and joined the weight transport. Returns the newest
        version it must load before generating, which is published again until it acknowledges it,
        and the checkpoint save under way, if any."""
        self.source.rejoin(generator_id, incarnation)
        newest = self.publisher.pushed_version
        self.intake.rejoins.add(generator_id, newest)
        save = self.save_in_progress()
        return {"newest_version": newest, "save": None if save is None else {"version": save.version, "timeout_s": save.timeout_s}}

    def finish(self, reason: str = "training finished") -> dict[str, Any]:
        """Make sure the generators hold the final weights, then tell them to stop (every rank calls it)."""
        self.publisher.push_final(self.version)
        if self.weights is not None:
            self.weights.shutdown(reason)
        return self.summary()

    def summary(self) -> dict[str, Any]:
        active_s = self._busy_until - self._first_step_start
        return {
            "version": self.version,
            "samples": self.samples_consumed,
            "idle_s": self.idle_s,
            "idle_frac": self.idle_s / active_s if active_s > 0 else 0.0,
            "ack_waits": self.ack_waits,
            "bytes_pushed": self.weights.bytes_pushed if self.weights else 0,
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness_histogram.items())},
            **self.admission.summary(),
            **peak_memory(),
            **(self.source.stats() if self.source else {}),
            **(self.recorder.stats() if self.recorder else {}),
        }

    # ------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The learner's own counters (the policy, registry and queue have their own)."""
        return {
            "version": self.version,
            "samples": self.samples_consumed,
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness_histogram.items())},
            "ack_waits": self.ack_waits,
            "idle_s": self.idle_s,
            "admission": self.admission.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = self.publisher.pushed_version = int(state["version"])  # generators start from its weights
        self.samples_consumed = int(state["samples"])
        self.staleness_histogram = {int(k): int(v) for k, v in state["staleness_histogram"].items()}
        self.ack_waits = int(state["ack_waits"])
        self.idle_s = float(state["idle_s"])
        self.admission.load_state_dict(state.get("admission", {}))

    def save_checkpoint(self, directory: str | Path) -> str:
        """A sharded checkpoint in `directory`/step_<version> (every rank calls it); returns its path."""
        states = {"learner": self.state_dict(), "schedule": self.policy.schedule_state_dict()}
        if self.cfg.learner.lora.rank > 0 and self.rank == 0:  # rank 0 writes meta.json
            states["lora"] = self.adapter_record()
        source_state = self.source.state_dict() if self.source is not None else {}
        if source_state:  # an offline source keeps nothing: no key, as checkpoints always had for it
            states["queue"] = source_state
        # Nothing is pushed or taken while the save runs: the generators, told so, wait up to
        # train.checkpoint_timeout_s instead of failing after wire.timeout_s.
        self._announce_save(saving=True)
        try:
            path = checkpoint.save(Path(directory), self.version, self.policy, states, model_dir=self.model_dir,
                                   rank=self.rank, world_size=self.world_size, keep=self.cfg.train.keep_checkpoints,
                                   run=self.run_record() if self.rank == 0 else None)
        finally:  # a failed save fails the run; until then the generators' waits are bounded as usual
            self._announce_save(saving=False)
        return str(path)

    def _announce_save(self, saving: bool) -> None:
        """Rank 0: tell the generators that a checkpoint save of this version starts, or ended; and
        remember it for a generator that rejoins during the save (`save_in_progress`)."""
        self._save_started = time.monotonic() if saving else None
        if self.weights is not None:
            timeout_s = self.cfg.train.checkpoint_timeout_s if saving else 0.0
            self.weights.announce(SaveNotice(self.version, saving=saving, timeout_s=timeout_s))

    def save_in_progress(self) -> SaveNotice | None:
        """The checkpoint save under way, its bound counted from now (None: none): a generator that
        rejoins during a save subscribed after its announcement and must be told (`generator_rejoined`)."""
        started = self._save_started
        if started is None:
            return None
        remaining = max(0.0, self.cfg.train.checkpoint_timeout_s - (time.monotonic() - started))
        return SaveNotice(self.version, saving=True, timeout_s=remaining)

    def run_record(self) -> dict[str, Any] | None:
        """What a resume checks against (resume.py; None: none), made at the first save: it hashes data files."""
        if self._run_record is None and self._make_run_record is not None:
            self._run_record = self._make_run_record()
        return self._run_record

    def adapter_record(self) -> dict[str, Any]:
        """What a LoRA checkpoint keeps to refuse a resume onto another base or adapter (its base's
        weight files are hashed once, at the first save)."""
        if self._adapter_record is None:
            self._adapter_record = lora.adapter_record(self.cfg.learner.lora, self.model_dir)
        return self._adapter_record

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Continue from a checkpoint (every rank calls it, any world size); returns its meta."""
        lora.check_adapter_resume(checkpoint.read_meta(checkpoint.latest(path)).get("states") or {},
                                  self.cfg.learner.lora, self.model_dir, str(path))
        meta = checkpoint.load(Path(path), self.policy, self.rank)
        if self.recorder is not None:  # a recording that starts here starts from this checkpoint
            self.recorder.checkpoint = meta["path"]
        states = meta["states"]
        self.load_state_dict(states["learner"])
        self.policy.load_schedule_state_dict(states["schedule"])
        if self.source is not None:
            self.source.load_state_dict(states.get("queue", {}))
        return meta

    def export_hf(self, outdir: str | Path) -> str:
        """The current policy in Hugging Face format (every rank calls it; rank 0 writes)."""
        from asyncgrpo.learner.export import export_adapter, write_hf

        named = list(self.policy.full_state_dict())
        if self.rank == 0:
            write_hf(named, self.model_dir, Path(outdir))
        if self.policy.loras:  # LoRA: the adapter directory too, beside the merged weights
            export_adapter(self.policy, self.cfg.learner.lora, self.model_dir, self.rank, Path(outdir) / lora.EXPORTED_ADAPTER_DIR)
        return str(outdir)

    # ------------------------------------------------------------------------------- probes

    def sequence_logprobs(self, sequences: list[list[int]]) -> list[np.ndarray]:
        """Every rank calls it (each forward gathers the sharded weights); all ranks return the same."""
        return self.policy.sequence_logprobs(sequences)

    def recent_samples(self, num_groups: int) -> list[dict[str, Any]]:
        """The first `num_groups` groups of the last step, as token ids, for the driver to decode and log."""
        version, groups = self._last_taken
        return sample_records(groups, version, num_groups)

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
        if self.source is not None:
            self.source.close()
        if self.weights is not None:
            self.weights.close()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
