"""The interface between the group stream and the learner: `GroupSource`, what learner rank 0 calls
on whatever hands it groups, and `ListSource`, a fixed list of groups (tests, offline benchmarks).

The other sources are the replay queue (asyncgrpo/queue/replay_queue.py), fed by the generators,
and `recording.RecordedSource`, a recorded stream (`asyncgrpo replay`). tests/unit/test_group_sources.py
checks that each implements every member with the Protocol's signature, and that the learner calls
nothing on its source that the Protocol does not name.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from asyncgrpo.wire import ScoredGroup


class QueueTimeout(TimeoutError):
    """`take` did not get its groups in time."""


class GroupSource(Protocol):
    """Where the learner takes its groups from: every member the learner (asyncgrpo/learner/) uses."""

    @property
    def depth(self) -> int:
        """Groups ready to be taken (the acknowledgement wait skips waiting when a step is ready)."""

    def take(self, num_groups: int, learner_version: int, timeout_s: float) -> list[ScoredGroup]:
        """`num_groups` groups fit to train on at `learner_version`, oldest first; raises
        `QueueTimeout` if they do not come within `timeout_s`."""

    def stats(self) -> dict[str, float]:
        """Counters for the step metrics and the summary (queue/*, wire/*)."""

    def generator_down(self, generator_id: int) -> None:
        """Generator `generator_id`'s process died and a restart is under way."""

    def set_admission_bound(self, bound: int) -> None:
        """Grant new slots only within `bound` (<= train.max_staleness) versions of a generator's
        weights (train.staleness_control=divergence); what is granted stays trainable."""

    def rejoin(self, generator_id: int, incarnation: int) -> None:
        """Incarnation `incarnation` of generator `generator_id` is up."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the source (JSON); {} when nothing."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's `state_dict()` ({} for a checkpoint that holds none)."""

    def close(self) -> None:
        """Release the source's sockets, threads or files."""


class OfflineSource:
    """The members of a source that no generator feeds: restarts are ignored, and a checkpoint keeps
    nothing of it."""

    def generator_down(self, generator_id: int) -> None:
        pass

    def set_admission_bound(self, bound: int) -> None:
        pass  # nothing is granted: the stream is given

    def rejoin(self, generator_id: int, incarnation: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class ListSource(OfflineSource):
    """A fixed list of groups, taken in order (tests and offline benchmarks)."""

    def __init__(self, groups: Sequence[ScoredGroup]) -> None:
        self._groups = deque(groups)
        self.consumed = 0

    @property
    def depth(self) -> int:
        return len(self._groups)

    def take(self, num_groups: int, learner_version: int, timeout_s: float) -> list[ScoredGroup]:
        if len(self._groups) < num_groups:
            raise QueueTimeout(f"the list holds {len(self._groups)} groups, {num_groups} asked for")
        self.consumed += num_groups
        return [self._groups.popleft() for _ in range(num_groups)]

    def stats(self) -> dict[str, float]:
        return {"queue/depth": len(self._groups), "queue/consumed": self.consumed}

    def close(self) -> None:
        pass
