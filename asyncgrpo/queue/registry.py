"""What the learner knows of each generator: sequence numbers, loaded weights, reported counters,
and whether it is down for a restart.

The replay queue's receiving thread feeds it (`admit` for each group, `on_ack`, `on_heartbeat`);
the learner reads it (acknowledged versions, per-step increases of the generators' counters) and
asks it whether the reports end the run (`check_reports`: rejected weights, a reward outage, an
environment outage).

Sequence numbers are per generator *incarnation* (its process: 0 for the first, +1 per restart) and
ordered: an old one is a duplicate, a gap is loss. A newer incarnation starts again at 0, so its
numbers are never taken for duplicates; what the replaced one announced (heartbeats) but never
delivered is already counted as lost, and whatever it sends late is dropped and counted: groups under
`queue/old_incarnation`, acknowledgements and heartbeats under `queue/old_incarnation_reports`.

Nothing here is checkpointed: sequence numbers and acknowledgements are per run, and where the
prompts continue is the dispatcher's (asyncgrpo/queue/dispatch.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncgrpo.rewards.errors import ErrorRate, ErrorWindow, env_outage_reason, outage_reason
from asyncgrpo.wire import Heartbeat, VersionAck

log = logging.getLogger(__name__)

# Heartbeat field (cumulative per generator) -> the per-step metric of its increase.
REPORTED_COUNTERS = {
    "idle_s": "time/gen_idle_s",
    "reward_errors": "reward/errors",
    "groups_dropped": "reward/groups_dropped",
    "reward_calls": "reward/calls",
    "env_calls": "env/calls",
    "env_errors": "env/errors",
}


class RunStopped(RuntimeError):
    """What the generators reported ends the run; the message is the whole reason, on one line."""


class WeightsRejected(RunStopped):
    """A generator reported weight messages it could not use."""


class RewardOutage(RunStopped):
    """Reward calls fail beyond reward.max_error_rate over reward.error_window_steps."""


class EnvOutage(RunStopped):
    """Environment calls fail beyond env.max_error_rate over env.error_window_steps."""


@dataclass
class GeneratorState:
    incarnation: int = 0
    next_seq: int = 0
    acked_version: int = -1
    last_seen: float = field(default_factory=time.monotonic)
    reported_loss: bool = False
    # The newest cumulative counters reported, and those already turned into per-step increases.
    reported: dict[str, float] = field(default_factory=lambda: dict.fromkeys(REPORTED_COUNTERS, 0.0))
    logged: dict[str, float] = field(default_factory=lambda: dict.fromkeys(REPORTED_COUNTERS, 0.0))
    # What the replaced incarnations reported: a restarted process counts from 0 again.
    reported_before: dict[str, float] = field(default_factory=lambda: dict.fromkeys(REPORTED_COUNTERS, 0.0))
    weights_rejected: int = 0
    rejected_before: int = 0
    rejection: str = ""
    delta_mismatches: int = 0  # this incarnation's deltas it could not apply (weights.delta), as last reported
    down: bool = False  # its process died; the driver is starting the next incarnation


class GeneratorRegistry:
    """Thread-safe: written by the queue's receiving thread, read by the learner."""

    def __init__(self, reward_window: ErrorWindow | None = None, env_window: ErrorWindow | None = None) -> None:
        """`reward_window`, `env_window`: the windows that decide a reward or an environment outage
        (None: those errors never end the run)."""
        self.generators: dict[int, GeneratorState] = {}
        self.lost = self.duplicates = 0
        self.old_incarnation = self.old_incarnation_reports = 0  # groups; acknowledgements and heartbeats
        self.reward_window, self.env_window = reward_window, env_window
        # term -> the first error any generator reported for it (the first heartbeat to carry it wins).
        self.first_reward_errors: dict[str, str] = {}
        self.first_env_error = ""  # the same for environment calls
        self._last_rejoin = float("-inf")
        # weights.delta: generator -> the version it holds, for each that reported a delta it could
        # not apply (a lost one) since the learner last looked: it needs a full push.
        self.full_push_wanted: dict[int, int] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------- receiving thread

    def admit(self, generator_id: int, seq: int, incarnation: int = 0) -> bool:
        """Account for a group's sequence number; False for a duplicate or a group of a replaced
        incarnation (the group must not enter)."""
        with self._lock:
            state = self._current(generator_id, incarnation)
            if state is None:
                self.old_incarnation += 1
                return False
            if seq < state.next_seq:
                self.duplicates += 1
                return False
            self._skip_to(generator_id, state, seq)
            state.next_seq = seq + 1
            return True

    def on_ack(self, ack: VersionAck) -> None:
        with self._lock:
            state = self._current(ack.generator_id, ack.incarnation)
            if state is None:
                self.old_incarnation_reports += 1
            else:
                state.acked_version = max(state.acked_version, ack.version)

    def on_heartbeat(self, beat: Heartbeat) -> None:
        with self._lock:
            state = self._current(beat.generator_id, beat.incarnation)
            if state is None:
                self.old_incarnation_reports += 1
                return
            # A heartbeat announces how many groups were sent: a gap at the tail is loss too.
            self._skip_to(beat.generator_id, state, beat.next_seq)
            # It also names the loaded version: an acknowledgement that found the socket full (and
            # was dropped) is made good by the next heartbeat.
            state.acked_version = max(state.acked_version, beat.version)
            for name in REPORTED_COUNTERS:
                reported = state.reported_before[name] + float(getattr(beat, name))
                state.reported[name] = max(state.reported[name], reported)
            if state.rejected_before + beat.weights_rejected > state.weights_rejected:
                state.weights_rejected = state.rejected_before + beat.weights_rejected
                state.rejection = beat.rejection
            if beat.delta_mismatches > state.delta_mismatches:
                state.delta_mismatches = beat.delta_mismatches
                self.full_push_wanted[beat.generator_id] = beat.version
            for term, text in beat.reward_first_errors.items():
                self.first_reward_errors.setdefault(term, text)
            self.first_env_error = self.first_env_error or beat.env_first_error

    def _current(self, generator_id: int, incarnation: int) -> GeneratorState | None:
        """With the lock held: the state of `generator_id` if `incarnation` is its current one (a
        newer one replaces it first); None for a message of a replaced incarnation."""
        state = self.generators.setdefault(generator_id, GeneratorState())
        if incarnation < state.incarnation:
            return None
        if incarnation > state.incarnation:
            self._replace(state, incarnation)
        state.last_seen = time.monotonic()
        return state

    def _replace(self, state: GeneratorState, incarnation: int) -> None:
        """A new process of this generator: its sequence numbers start again at 0 and it has loaded
        nothing yet. What the old one announced but never delivered was counted lost by its
        heartbeats; what it did not announce is not known to have existed."""
        state.incarnation = incarnation
        state.next_seq, state.acked_version, state.down = 0, -1, False
        state.reported_before = dict(state.reported)
        state.rejected_before = state.weights_rejected
        state.delta_mismatches = 0

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
        """The newest weight version each generator acknowledged (-1: none yet), leaving out those
        that are down: nobody can load weights for them until their restart rejoins."""
        with self._lock:
            return {g: self.generators[g].acked_version if g in self.generators else -1 for g in generator_ids
                    if not (g in self.generators and self.generators[g].down)}

    # ---------------------------------------------------------------------------- restarts

    def mark_down(self, generator_id: int) -> int:
        """The generator's process died and a restart is under way (the driver says so). Returns the
        incarnation that died: the newest known, rejoined or heard from (the driver starts the next
        only after this report)."""
        with self._lock:
            state = self.generators.setdefault(generator_id, GeneratorState())
            state.down = True
            return state.incarnation

    def rejoin(self, generator_id: int, incarnation: int) -> None:
        """Incarnation `incarnation` of the generator is up: from now on only its messages count."""
        with self._lock:
            state = self.generators.setdefault(generator_id, GeneratorState())
            if incarnation <= state.incarnation:
                raise ValueError(f"generator {generator_id}: incarnation {incarnation} rejoins, but "
                                 f"{state.incarnation} was already seen")
            self._replace(state, incarnation)
            state.last_seen = self._last_rejoin = time.monotonic()

    def restart_grace_until(self, timeout_s: float) -> float:
        """Until when (time.monotonic) a wait on the generators must not time out because of a
        restart: forever while one is down (the driver bounds the restart itself), and `timeout_s`
        after the last one rejoined (it still has to load the weights and generate)."""
        with self._lock:
            if any(s.down for s in self.generators.values()):
                return float("inf")
            return self._last_rejoin + timeout_s

    def report_increments(self) -> dict[str, float]:
        """What the generators reported since the previous call, summed over generators: idle
        seconds, reward errors, reward calls, groups dropped by the reward policy (which never
        reach the queue), environment calls and their errors. Called once per learner step: it closes
        that step in the error windows and adds their rates (what max_error_rate bounds)."""
        with self._lock:
            increments = self._unlogged()
            for state in self.generators.values():
                state.logged.update(state.reported)
            for window, prefix in ((self.reward_window, "reward"), (self.env_window, "env")):
                if window is not None:
                    window.close_step(int(increments[f"{prefix}/errors"]), int(increments[f"{prefix}/calls"]))
                    increments[f"{prefix}/error_rate"] = window.current().rate
        return increments

    def reported_total(self, name: str) -> float:
        """A reported counter (a `REPORTED_COUNTERS` field) summed over generators and their
        incarnations, as last reported: for the audit's groups given back (asyncgrpo/queue/audit.py)."""
        with self._lock:
            return sum(state.reported[name] for state in self.generators.values())

    def _unlogged(self) -> dict[str, float]:
        increments = dict.fromkeys(REPORTED_COUNTERS.values(), 0.0)
        for state in self.generators.values():
            for name, metric in REPORTED_COUNTERS.items():
                increments[metric] += state.reported[name] - state.logged[name]
        return increments

    def check_reports(self) -> None:
        """Raise `RunStopped` if the generators' reports end the run (`check_weights_accepted`,
        `check_reward_errors`, `check_env_errors`)."""
        self.check_weights_accepted()
        self.check_reward_errors()
        self.check_env_errors()

    def check_reward_errors(self) -> None:
        """Raise `RewardOutage` if reward calls fail beyond reward.max_error_rate over the window
        (the closed steps and what was reported since): training on zeros, or on nothing while every
        group is dropped, would only hide the outage."""
        with self._lock:
            rate = self._beyond(self.reward_window, "reward")
            if rate is None:
                return
            assert self.reward_window is not None
            reason = outage_reason(rate, self.reward_window, self.first_reward_errors)
        raise RewardOutage(reason)

    def check_env_errors(self) -> None:
        """Raise `EnvOutage` if environment calls fail beyond env.max_error_rate over the window:
        an environment that is down would otherwise be trained on as zero rewards."""
        with self._lock:
            rate = self._beyond(self.env_window, "env")
            if rate is None:
                return
            assert self.env_window is not None
            reason = env_outage_reason(rate, self.env_window, self.first_env_error)
        raise EnvOutage(reason)

    def _beyond(self, window: ErrorWindow | None, prefix: str) -> ErrorRate | None:
        """With the lock held: `window`'s rate with what was reported since the last step (the
        counters `<prefix>/errors` and `<prefix>/calls`) if it is beyond its limit, else None."""
        if window is None:
            return None
        pending = self._unlogged()
        rate = window.current(int(pending[f"{prefix}/errors"]), int(pending[f"{prefix}/calls"]))
        return rate if window.exceeded(rate) else None

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

    def take_full_push_requests(self) -> dict[int, int]:
        """weights.delta: the generators that reported a delta they could not apply since the last
        call, each with the version it holds (it needs a full push of a newer one)."""
        with self._lock:
            wanted, self.full_push_wanted = self.full_push_wanted, {}
        return wanted

    def last_seen(self) -> str:
        """For timeout messages: how long ago each generator was heard from."""
        with self._lock:
            if not self.generators:
                return "none ever connected"
            now = time.monotonic()
            return ", ".join(f"gen {g}: {now - s.last_seen:.1f} s ago{' (down, restarting)' if s.down else ''}"
                             for g, s in sorted(self.generators.items()))

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"queue/lost": self.lost, "queue/duplicates": self.duplicates,
                    "queue/old_incarnation": self.old_incarnation,
                    "queue/old_incarnation_reports": self.old_incarnation_reports}
