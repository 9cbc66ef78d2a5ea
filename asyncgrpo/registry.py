"""What the learner knows of each generator: sequence numbers, loaded weights, reported counters.

The replay queue's receiving thread feeds it (`admit` for each group, `on_ack`, `on_heartbeat`);
the learner reads it (acknowledged versions, per-step increases of the generators' counters) and
asks it whether the reports end the run (`check_reports`: rejected weights, a reward outage).
Sequence numbers are per generator and ordered: an old one is a duplicate, a gap is loss.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncgrpo.rewards.errors import RewardErrorWindow, outage_reason
from asyncgrpo.wire import Heartbeat, VersionAck

log = logging.getLogger(__name__)

# Heartbeat field (cumulative per generator) -> the per-step metric of its increase.
REPORTED_COUNTERS = {
    "idle_s": "time/gen_idle_s",
    "reward_errors": "reward/errors",
    "groups_dropped": "reward/groups_dropped",
    "reward_calls": "reward/calls",
}


class RunStopped(RuntimeError):
    """What the generators reported ends the run; the message is the whole reason, on one line."""


class WeightsRejected(RunStopped):
    """A generator reported weight messages it could not use."""


class RewardOutage(RunStopped):
    """Reward calls fail beyond reward.max_error_rate over reward.error_window_steps."""


@dataclass
class GeneratorState:
    next_seq: int = 0
    acked_version: int = -1
    last_seen: float = field(default_factory=time.monotonic)
    reported_loss: bool = False
    # The newest cumulative counters reported, and those already turned into per-step increases.
    reported: dict[str, float] = field(default_factory=lambda: dict.fromkeys(REPORTED_COUNTERS, 0.0))
    logged: dict[str, float] = field(default_factory=lambda: dict.fromkeys(REPORTED_COUNTERS, 0.0))
    weights_rejected: int = 0
    rejection: str = ""


class GeneratorRegistry:
    """Thread-safe: written by the queue's receiving thread, read by the learner."""

    def __init__(self, reward_window: RewardErrorWindow | None = None) -> None:
        """`reward_window`: the window that decides a reward outage (None: reward errors never end the run)."""
        self.generators: dict[int, GeneratorState] = {}
        self.lost = self.duplicates = 0
        self.reward_window = reward_window
        # term -> the first error any generator reported for it (the first heartbeat to carry it wins).
        self.first_reward_errors: dict[str, str] = {}
        # Groups each generator sent in the runs before a resume: its sequence numbers restart at 0.
        self._received_before: dict[int, int] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------- receiving thread

    def admit(self, generator_id: int, seq: int) -> bool:
        """Account for a group's sequence number; False for a duplicate (the group must not enter)."""
        with self._lock:
            state = self._seen(generator_id)
            if seq < state.next_seq:
                self.duplicates += 1
                return False
            self._skip_to(generator_id, state, seq)
            state.next_seq = seq + 1
            return True

    def on_ack(self, ack: VersionAck) -> None:
        with self._lock:
            state = self._seen(ack.generator_id)
            state.acked_version = max(state.acked_version, ack.version)

    def on_heartbeat(self, beat: Heartbeat) -> None:
        with self._lock:
            state = self._seen(beat.generator_id)
            # A heartbeat announces how many groups were sent: a gap at the tail is loss too.
            self._skip_to(beat.generator_id, state, beat.next_seq)
            # It also names the loaded version: an acknowledgement that found the socket full (and
            # was dropped) is made good by the next heartbeat.
            state.acked_version = max(state.acked_version, beat.version)
            for name in REPORTED_COUNTERS:
                state.reported[name] = max(state.reported[name], float(getattr(beat, name)))
            if beat.weights_rejected > state.weights_rejected:
                state.weights_rejected, state.rejection = beat.weights_rejected, beat.rejection
            for term, text in beat.reward_first_errors.items():
                self.first_reward_errors.setdefault(term, text)

    def _seen(self, generator_id: int) -> GeneratorState:
        state = self.generators.setdefault(generator_id, GeneratorState())
        state.last_seen = time.monotonic()
        return state

    def _skip_to(self, generator_id: int, state: GeneratorState, next_seq: int) -> None:
        missing = next_seq - state.next_seq
        if missing <= 0:
            return
        self.lost += missing
        if not state.reported_loss:
            state.reported_loss = True
            log.warning("generator %d: %d group(s) lost in transit before sequence number %d; "
                        "later losses are only counted under queue/lost", generator_id, missing, next_seq)
        state.next_seq = next_seq

    # ---------------------------------------------------------------------------------- learner

    def acked_versions(self, generator_ids: Sequence[int]) -> dict[int, int]:
        """The newest weight version each generator acknowledged (-1: none yet)."""
        with self._lock:
            return {g: self.generators[g].acked_version if g in self.generators else -1 for g in generator_ids}

    def min_acked_version(self) -> int:
        with self._lock:
            return min((s.acked_version for s in self.generators.values()), default=-1)

    def report_increments(self) -> dict[str, float]:
        """What the generators reported since the previous call, summed over generators: idle
        seconds, reward errors, reward calls and groups dropped by the reward policy (which never
        reach the queue). Called once per learner step: it closes that step in the reward error window."""
        with self._lock:
            increments = self._unlogged()
            for state in self.generators.values():
                state.logged.update(state.reported)
            if self.reward_window is not None:
                self.reward_window.close_step(int(increments["reward/errors"]), int(increments["reward/calls"]))
                increments["reward/error_rate"] = self.reward_window.current().rate  # what max_error_rate bounds
        return increments

    def _unlogged(self) -> dict[str, float]:
        increments = dict.fromkeys(REPORTED_COUNTERS.values(), 0.0)
        for state in self.generators.values():
            for name, metric in REPORTED_COUNTERS.items():
                increments[metric] += state.reported[name] - state.logged[name]
        return increments

    def check_reports(self) -> None:
        """Raise `RunStopped` if the generators' reports end the run (`check_weights_accepted`,
        `check_reward_errors`)."""
        self.check_weights_accepted()
        self.check_reward_errors()

    def check_reward_errors(self) -> None:
        """Raise `RewardOutage` if reward calls fail beyond reward.max_error_rate over the window
        (the closed steps and what was reported since): training on zeros, or on nothing while every
        group is dropped, would only hide the outage."""
        if self.reward_window is None:
            return
        with self._lock:
            pending = self._unlogged()
            rate = self.reward_window.current(int(pending["reward/errors"]), int(pending["reward/calls"]))
            if not self.reward_window.exceeded(rate):
                return
            reason = outage_reason(rate, self.reward_window, self.first_reward_errors)
        raise RewardOutage(reason)

    def check_weights_accepted(self) -> None:
        """Raise `WeightsRejected` if a generator reported weight messages it could not use: it
        would never load another version, so the run must end now, with the reason."""
        with self._lock:
            rejected = {g: (s.weights_rejected, s.rejection) for g, s in self.generators.items() if s.weights_rejected}
        if rejected:
            details = "; ".join(f"generator {g}: {count} rejected, first: {reason}"
                                for g, (count, reason) in sorted(rejected.items()))
            raise WeightsRejected(f"a generator could not accept weight pushes ({details}); check "
                                  "wire.max_message_bytes and weights.chunk_bytes")

    def last_seen(self) -> str:
        """For timeout messages: how long ago each generator was heard from."""
        with self._lock:
            if not self.generators:
                return "none ever connected"
            now = time.monotonic()
            return ", ".join(f"gen {g}: {now - s.last_seen:.1f} s ago" for g, s in sorted(self.generators.items()))

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"queue/lost": self.lost, "queue/duplicates": self.duplicates}

    # ------------------------------------------------------------------------------- checkpoint

    def groups_received(self, generator_id: int) -> int:
        """The groups `generator_id` has sent as far as the learner knows (consumed, dropped or still
        queued), across resumes: a resumed generator skips that many prompts."""
        with self._lock:
            state = self.generators.get(generator_id)
            return self._received_before.get(generator_id, 0) + (state.next_seq if state else 0)

    def state_dict(self) -> dict[str, Any]:
        ids = set(self.generators) | set(self._received_before)
        return {"generators": {str(g): {"groups_received": self.groups_received(g)} for g in sorted(ids)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Only the prompt positions carry over; sequence numbers and acknowledgements are per run."""
        with self._lock:
            self._received_before = {int(g): int(s["groups_received"]) for g, s in state.get("generators", {}).items()}
