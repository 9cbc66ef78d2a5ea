"""The generator as a Ray actor (`GeneratorActor`): it builds its real parts in the actor's own
process from the run's config and its `GeneratorSpec`, and can be kept between runs and reset for
the next (asyncgrpo/driver/engine_pool.py)."""

from __future__ import annotations

from asyncgrpo.rollout.generator import Generator
from asyncgrpo.rollout.parts import build_parts
from asyncgrpo.rollout.spec import GeneratorSpec
from asyncgrpo.schema import Config


class GeneratorActor(Generator):
    """The Ray actor: constructed from config, so the engine and sockets are built in the actor's process."""

    def __init__(self, cfg: Config, spec: GeneratorSpec) -> None:
        super().__init__(cfg, spec, build_parts(cfg, spec))

    # ------------------------------------------------------------- kept between runs (engine_pool)

    _pool_key: str = ""
    _released = False

    def reusable_key(self) -> str:
        """The engine settings this actor was started with (`driver.engine_pool.engine_key`) once a
        run has released it; "" while a run holds it (a driver that died without releasing it leaves
        it in an unknown state, perhaps still generating): then it is not to be reused."""
        return self._pool_key if self._released else ""

    def set_pool_key(self, key: str) -> None:
        self._pool_key = key

    def release(self) -> None:
        """The run is over and this engine stays for the next: close its sockets and reward threads."""
        self.close()
        self._released = True

    def reset(self, cfg: Config, spec: GeneratorSpec) -> None:
        """Become a new run's generator (the constructor's arguments) on the running engine: its
        starting weights, seed, prompt stream, rewards, sockets and counters; vLLM is not restarted."""
        self._released = False
        self.close()  # idempotent: release() has closed them already
        Generator.__init__(self, cfg, spec, build_parts(cfg, spec, engine=self.engine))

    def node(self) -> dict[str, str]:
        """The Ray node this generator runs on (node_id, node_ip): run_dir/actors.json, the reach check."""
        from asyncgrpo.wire.reach import this_node

        return this_node()
