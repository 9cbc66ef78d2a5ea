"""The parts a `Generator` runs on (`GeneratorParts`), and `build_parts`, which makes the real ones
from the run's config and a generator's spec: vLLM, the tokenizer, the task and its prompt stream,
the scorer, the groups and weights sockets and the grant channel, and what the generator takes of
the sections rollout/ does not own (`episode_settings`, wire.timeout_s). Tests build theirs from
fakes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from asyncgrpo.composition import engine_adapter, pushed_adapters, run_task, weights_backend
from asyncgrpo.envs import EnvironmentSpec, episode_rules, make_environment
from asyncgrpo.rewards.scorer import Scorer
from asyncgrpo.rollout.engine import Completion, FinishedGroup, VLLMEngine
from asyncgrpo.rollout.episodes import EpisodeSettings
from asyncgrpo.rollout.sink import GroupSink, with_faults
from asyncgrpo.rollout.spec import GeneratorSpec, engine_settings
from asyncgrpo.rollout.tickets import PositionedPrompts, TicketClient
from asyncgrpo.runtime.resources import pin_to_cores
from asyncgrpo.schema import Config
from asyncgrpo.tasks import Task, run_stream
from asyncgrpo.weights import WeightReceiver, make_receiver
from asyncgrpo.weights.adapters import adapter_receiver
from asyncgrpo.wire import GrantDealer, Sender, Subscriber, holder_identity


class SamplingEngine(Protocol):
    """What the generator needs of an engine (`VLLMEngine`): a step at a time for its loop,
    `generate` for evaluations, `sequence_logprobs` for probes."""

    weight_load_path: str
    running_sequences: int

    def submit(self, request_id: str, prompt: Sequence[int], *, n: int, max_tokens: int,
               temperature: float, stop: Sequence[str] = ()) -> None: ...

    def step(self) -> list[FinishedGroup]: ...

    def abort(self, request_ids: Sequence[str] | None = None) -> list[str]: ...

    def label_version(self, version: int) -> None: ...

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, max_tokens: int | Sequence[int],
                 temperature: float, seed: int | None = None, stop: Sequence[str] = ()) -> list[list[Completion]]: ...

    def sequence_logprobs(self, sequences: Sequence[Sequence[int]], *, temperature: float) -> list[np.ndarray]: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


@dataclass
class GeneratorParts:
    """`engine` samples, `tokenizer` and `task` make and score the prompts, `scorer` computes the
    rewards, `sink` sends to the learner, `weights` receives its pushes, `tickets` asks for slots and
    `positioned` reads their prompts from the run's one prompt stream; `env` makes each episode's
    environment. The settings from sections rollout/ does not own: `episode_settings` (built by
    `episode_settings`) rules the episodes, `wait_timeout_s` (wire.timeout_s) bounds the waits on
    the learner (rollout/waits.py) and, beyond the rewards' own bound, on a batch's rewards
    (rollout/scoring.py)."""

    engine: SamplingEngine
    tokenizer: Any
    task: Task
    scorer: Scorer
    sink: GroupSink
    weights: WeightReceiver
    tickets: TicketClient
    positioned: PositionedPrompts
    env: EnvironmentSpec | None  # env.name="": None, every rollout one turn
    episode_settings: EpisodeSettings
    wait_timeout_s: float


def episode_settings(cfg: Config) -> EpisodeSettings:
    """The run's episode settings: rollout.*, the engine's context (model.max_positions) and the
    env.* rules (envs.episode_rules)."""
    r = cfg.rollout
    return EpisodeSettings(r.samples_per_prompt, r.max_new_tokens, r.temperature, cfg.model.max_positions,
                           episode_rules(cfg.env))


def build_parts(cfg: Config, spec: GeneratorSpec, engine: VLLMEngine | None = None) -> GeneratorParts:
    """The real parts (vLLM on `spec.model_dir`, which holds `spec.initial_version`'s weights);
    `engine`: a running one to take those weights instead of a new one (rollout.engine_pool)."""
    # First: the threads started below inherit the pinning.
    pin_to_cores(list(spec.cores), torch_threads=None, set_num_threads=torch.set_num_threads)
    from transformers import (
        AutoTokenizer,  # slow to import; only where a real generator is built
    )

    tokenizer = AutoTokenizer.from_pretrained(spec.model_dir)
    task = run_task(cfg, tokenizer)
    # Rewards (asyncgrpo/rewards/scorer.py): scorer.submit() scores without blocking generation.
    scorer = Scorer(task, cfg.reward)
    base_dir = spec.base_model_dir or spec.model_dir
    # rollout.lora_apply=vllm: the engine holds the base model and the adapter apart (a resumed run's
    # starting directory holds merged weights and, in adapter/, the adapter they were merged from).
    adapters = pushed_adapters(cfg, base_dir)  # what a LoRA run's pushes carry; None for whole models
    adapter = engine_adapter(cfg, adapters, spec.model_dir, base_dir)
    engine_dir = spec.model_dir if adapter is None else base_dir
    if engine is None:
        engine = VLLMEngine(engine_dir, seed=spec.seed, adapter=adapter, max_model_len=cfg.model.max_positions,
                            **engine_settings(cfg.rollout))
    else:
        engine.abort()  # a run that stopped mid-generation left requests (it aborts them: to be sure)
        engine.load_model_dir(engine_dir)
        if adapter is not None:
            engine.serve_adapter(adapter)  # this run's PEFT config, not the engine's first run's
    # Also a new engine: its start-up drew from the random streams, a reused one's last run did.
    engine.reseed(spec.seed)
    # Room on the wire for one vLLM call's groups: a call's batch goes out without waiting for
    # the learner's receiving thread, which competes with training for its core and the GIL.
    # Memory stays bounded: a call's groups in the socket buffers, the rest by the slots granted.
    sink = with_faults(Sender(spec.groups_endpoint, high_water_mark=max(8, spec.groups_per_call),
                              curve=spec.curve))  # with_faults: a chaos run's lost or corrupted groups
    subscriber = Subscriber(spec.weights_endpoint, cfg.wire.max_message_bytes, curve=spec.curve)
    # After the engine: on a GPU, vLLM has set up this process's device by now.
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    weights = make_receiver(cfg.weights, weights_backend(cfg), subscriber, spec.model_dir, device, adapters=adapters,
                            engine_dtype=cfg.rollout.dtype, startup_timeout_s=cfg.wire.startup_timeout_s,
                            timeout_s=cfg.wire.timeout_s)
    # A LoRA run's adapter pushes arrive merged onto the run's model, or as the engine's adapter
    # (rollout.lora_apply; weights/adapters.py).
    weights = adapter_receiver(weights, base_dir, adapters, cfg.rollout.lora_apply)
    grants = GrantDealer(spec.tickets_endpoint, holder_identity(spec.generator_id, spec.incarnation), curve=spec.curve)
    # Its prompts come from the run's one stream, at the positions it is granted.
    return GeneratorParts(engine=engine, tokenizer=tokenizer, task=task, scorer=scorer, sink=sink, weights=weights,
                          tickets=TicketClient(sink, grants, spec.generator_id, spec.incarnation),
                          positioned=PositionedPrompts(lambda: run_stream(task, cfg)), env=make_environment(cfg.env),
                          episode_settings=episode_settings(cfg), wait_timeout_s=cfg.wire.timeout_s)
