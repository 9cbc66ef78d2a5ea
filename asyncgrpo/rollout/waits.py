"""How long a generator's waits may last (`WaitLimit`): `wire.timeout_s`, or while learner rank 0
announced a checkpoint save, that save's bound (weights.base.SaveWatch): a save stops both pushes
and grants for longer than wire.timeout_s, and must not fail the run."""

from __future__ import annotations

import time

from asyncgrpo.weights.base import SaveWatch
from asyncgrpo.wire import WireTimeout


class WaitLimit:
    """Fails generator `generator_id`'s waits once they are past their limit, naming what did not
    happen; `timeout_s`: wire.timeout_s."""

    def __init__(self, generator_id: int, timeout_s: float) -> None:
        self.generator_id, self.timeout_s = generator_id, timeout_s
        self._save_logged: int | None = None  # the checkpoint save whose wait was logged (once per save)

    def check(self, started: float, saves: SaveWatch, state: str, what: str) -> None:
        """Fail a wait that began at `started` (time.monotonic) once it is past `wire.timeout_s`, or past
        the bound of the save `saves` watches; `state`: what the generator is doing, `what`: what
        did not happen, for the messages."""
        now, timeout_s = time.monotonic(), self.timeout_s
        if now <= started + timeout_s:
            return
        deadline = saves.deadline(started, timeout_s)
        if now <= deadline:
            if saves.notice is not None and self._save_logged != saves.notice.version:
                self._save_logged = saves.notice.version
                print(f"[generator {self.generator_id}] {state}: {what} for {now - started:.0f} s, as learner rank 0 "
                      f"is saving a checkpoint of version {saves.notice.version}; waiting for it up to "
                      f"{saves.notice.timeout_s:.0f} s from its announcement (train.checkpoint_timeout_s)", flush=True)
            return
        save = saves.describe() if deadline > started + timeout_s else ""
        raise WireTimeout(f"generator {self.generator_id} ({state}): {what} for {now - started:.0f} s"
                          + (f": {save}" if save else f" (wire.timeout_s={timeout_s:.0f})"))
