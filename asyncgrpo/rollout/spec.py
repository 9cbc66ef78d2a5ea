"""What one generator is started with (`GeneratorSpec`): who it is, where it connects, which weights
it starts from.

The driver builds one per generator (asyncgrpo/driver/actors.py) and passes it through Ray to
`GeneratorActor` (rollout/actor.py), which builds the real parts from it (rollout/parts.py); tests
hand it to `Generator` beside their fakes. A restart or the evaluator at the end of a run starts from
a copy that differs only in its incarnation and starting weights. Plain fields only: Ray pickles it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncgrpo.contract import call_sizes
from asyncgrpo.schema import Config, RolloutConfig
from asyncgrpo.wire.security import CurveClientKeys


def engine_settings(r: RolloutConfig) -> dict[str, Any]:
    """The VLLMEngine arguments rollout.* fixes when an engine is built (beside the model's
    directory and context, the seed and the adapter): a pooled engine serves a later run only where
    they are the same (driver/engine_pool.engine_key), since a reset does not rebuild the engine."""
    return {"dtype": r.dtype, "kv_cache_gib": r.kv_cache_gib,
            "gpu_memory_utilization": r.gpu_memory_utilization, "max_running_seqs": r.max_running_seqs,
            # Off with in-flight loads: a prefix cached under older weights would serve requests
            # admitted after a load, and no version would record it.
            "prefix_caching": not r.inflight_updates}


def generator_seed(cfg: Config, generator_id: int) -> int:
    """The engine's sampling seed: one per generator, so that no two sample alike."""
    return cfg.seed * 1000 + generator_id


@dataclass(frozen=True)
class GeneratorSpec:
    """One generator's start-up arguments, apart from the run's config."""

    generator_id: int
    # The starting weights, in Hugging Face format: the run's model, or a resumed checkpoint's export.
    model_dir: str
    # Learner rank 0's sockets: the groups go to the first, weights come from the second, grants
    # from the third.
    groups_endpoint: str
    weights_endpoint: str
    tickets_endpoint: str
    groups_per_call: int  # tickets asked for at once: the prompts of one vLLM call
    seed: int
    cores: tuple[int, ...] = ()  # the CPU cores it is pinned to; () = not pinned
    curve: CurveClientKeys | None = None  # its wire keys, with wire.curve
    initial_version: int = 0  # the version of the weights in model_dir
    incarnation: int = 0  # 0 for the generator's first process, +1 per restart
    # The run's model directory, which LoRA adapter pushes merge onto (weights.lora_push=adapter):
    # model_dir is a resumed run's export, merged weights. "" = model_dir.
    base_model_dir: str = ""

    @classmethod
    def for_run(cls, cfg: Config, generator_id: int, model_dir: str, endpoints: Mapping[str, str],
                groups_per_step: int, cores: Sequence[int] = (), curve: CurveClientKeys | None = None,
                initial_version: int = 0, base_model_dir: str = "") -> GeneratorSpec:
        """Generator `generator_id`'s first incarnation in a run whose learner rank 0 bound
        `endpoints` (groups, weights, tickets) and whose generators start from `model_dir`, holding
        `initial_version`; `groups_per_step`: train.groups_per_step, which rollout.groups_per_call=0
        shares out among the generators."""
        return cls(generator_id=generator_id, model_dir=model_dir, groups_endpoint=endpoints["groups"],
                   weights_endpoint=endpoints["weights"], tickets_endpoint=endpoints["tickets"],
                   groups_per_call=call_sizes(cfg.rollout.groups_per_call, cfg.rollout.num_generators,
                                              groups_per_step)[generator_id],
                   seed=generator_seed(cfg, generator_id), cores=tuple(cores), curve=curve,
                   initial_version=initial_version, base_model_dir=base_model_dir)

    def restarted(self, incarnation: int) -> GeneratorSpec:
        """The same generator's next process, from the same starting weights (it then rejoins)."""
        return dataclasses.replace(self, incarnation=incarnation)

    def starting_from(self, model_dir: str, version: int, incarnation: int) -> GeneratorSpec:
        """The same generator started again from other weights (`version`'s, in `model_dir`)."""
        return dataclasses.replace(self, model_dir=model_dir, initial_version=version, incarnation=incarnation)
