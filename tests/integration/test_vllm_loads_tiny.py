"""A saved tiny model loads in vLLM on CPU and its log-probs agree with transformers."""

import gc
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_scaled_tiny_model

from asyncgrpo.models.tiny import VLLM_CPU_ENGINE_KWARGS

# Engine in this process: starts faster than a separate engine-core process.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

pytestmark = pytest.mark.slow

PROMPTS = ["37+48=", "12+34="]
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_scaled_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    vllm = pytest.importorskip("vllm")
    engine = vllm.LLM(model=str(model_dir), **VLLM_CPU_ENGINE_KWARGS)
    yield engine
    del engine
    gc.collect()


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """Log-prob of each token after the first, given the tokens before it."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0, :-1]
    return logits.log_softmax(-1).gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]


def test_sampled_tokens_and_logprobs_match_transformers(llm, reference, model_dir: Path) -> None:
    from vllm import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    params = SamplingParams(n=4, max_tokens=5, logprobs=0, temperature=1.0, seed=0)
    outputs = llm.generate(PROMPTS, params)

    assert len(outputs) == len(PROMPTS)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        prompt_ids = tokenizer(prompt).input_ids
        assert list(output.prompt_token_ids) == prompt_ids
        assert len(output.outputs) == 4
        for completion in output.outputs:
            token_ids = list(completion.token_ids)
            assert 1 <= len(token_ids) <= 5
            assert len(completion.logprobs) == len(token_ids)
            assert completion.text == tokenizer.decode(token_ids, skip_special_tokens=True)
            sampled = torch.tensor(
                [
                    position[token].logprob
                    for position, token in zip(completion.logprobs, token_ids, strict=True)
                ]
            )
            expected = reference_logprobs(reference, prompt_ids + token_ids)[len(prompt_ids) - 1 :]
            torch.testing.assert_close(sampled, expected, atol=LOGPROB_TOLERANCE, rtol=0)


def test_prompt_logprobs_of_fixed_completion_match_transformers(
    llm, reference, model_dir: Path
) -> None:
    from vllm import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    token_ids = [*tokenizer("37+48=85").input_ids, tokenizer.eos_token_id]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    (output,) = llm.generate([{"prompt_token_ids": token_ids}], params)

    assert output.prompt_logprobs[0] is None
    vllm_logprobs = torch.tensor(
        [
            position[token].logprob
            for position, token in zip(output.prompt_logprobs[1:], token_ids[1:], strict=True)
        ]
    )
    expected = reference_logprobs(reference, token_ids)
    assert expected.min() < -3.0, "weights too close to uniform for a meaningful comparison"
    torch.testing.assert_close(vllm_logprobs, expected, atol=LOGPROB_TOLERANCE, rtol=0)


def test_engine_loads_new_weights_in_place_and_matches_the_reload_path(model_dir: Path, reference) -> None:
    """The CPU engine copies pushed weights into its live parameters (no vLLM reload): the log-probs
    then equal transformers' on the new weights, and equal what vLLM's own reload path gives."""
    pytest.importorskip("vllm")
    from asyncgrpo.rollout.engine import VLLMEngine

    engine = VLLMEngine(str(model_dir), seed=0, max_model_len=32, dtype="float32", kv_cache_gib=0.25, gpu_memory_utilization=0.3,
                        max_running_seqs=256, prefix_caching=True)
    assert engine.weight_load_path == "in_place"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    token_ids = [*tokenizer("37+48=85").input_ids, tokenizer.eos_token_id]
    generator = torch.Generator().manual_seed(1)
    moved = {name: p.detach() + 0.2 * torch.randn(p.shape, generator=generator)
             for name, p in reference.state_dict().items()}
    engine.load_weights(moved.items())
    in_place = torch.from_numpy(engine.sequence_logprobs([token_ids], temperature=1.0)[0])

    updated = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    updated.load_state_dict(moved)
    expected = reference_logprobs(updated, token_ids)
    assert (expected - reference_logprobs(reference, token_ids)).abs().max() > 0.1, "weights barely moved"
    torch.testing.assert_close(in_place, expected, atol=LOGPROB_TOLERANCE, rtol=0)

    engine.weight_load_path = "reload"
    engine.load_weights(moved.items())
    torch.testing.assert_close(torch.from_numpy(engine.sequence_logprobs([token_ids], temperature=1.0)[0]), in_place,
                               atol=1e-6, rtol=0)
    del engine
    gc.collect()


def test_the_step_loop_returns_each_group_once_with_the_version_of_every_token(model_dir: Path, reference) -> None:
    """vLLM driven a step at a time, as the generator's loop drives it: a group comes back once, when
    its n samples have finished; a load between two steps changes the version the later tokens
    report (the earlier keep theirs), with the running sequences continuing on their cache; a
    prompt longer than the context is refused at submission; abort empties the engine."""
    pytest.importorskip("vllm")
    from asyncgrpo.rollout.engine import VLLMEngine

    engine = VLLMEngine(str(model_dir), seed=0, max_model_len=32, dtype="float32", kv_cache_gib=0.25,
                        gpu_memory_utilization=0.3, max_running_seqs=64, prefix_caching=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine.label_version(3)
    prompts = {f"g{i}": tokenizer(p).input_ids for i, p in enumerate(PROMPTS * 3)}
    for request_id, prompt in prompts.items():
        engine.submit(request_id, prompt, n=2, max_tokens=12, temperature=1.0)
    assert engine.running_sequences == 12
    with pytest.raises(RuntimeError, match="submitted requests run"):
        engine.generate([prompts["g0"]], n=1, max_tokens=2, temperature=1.0)
    finished = engine.step()  # the prefill step samples every sequence's first token with version 3
    engine.load_weights(reference.state_dict().items())  # the same weights: only the label moves
    engine.label_version(4)
    while engine.running_sequences:
        finished += engine.step()
    assert sorted(group.request_id for group in finished) == sorted(prompts)
    for group in finished:
        assert len(group.completions) == 2
        for completion in group.completions:
            assert 1 <= completion.token_ids.size <= 12
            assert completion.versions.tolist() == [3] + [4] * (completion.token_ids.size - 1)
    with pytest.raises(ValueError):
        engine.submit("long", list(range(3, 40)), n=2, max_tokens=4, temperature=1.0)
    engine.submit("cut", prompts["g0"], n=2, max_tokens=8, temperature=1.0)
    engine.step()
    assert engine.abort() in (["cut"], []) and engine.running_sequences == 0
    assert len(engine.generate([prompts["g0"]], n=1, max_tokens=2, temperature=1.0)) == 1
    del engine


def test_an_episode_turn_ends_at_a_stop_text_and_the_next_continues_on_prompt_turns_and_observation(
        model_dir: Path) -> None:
    """Episodes on real vLLM: a turn ends at the environment's stop text (kept in the turn), the
    environment's observation is appended (policy mask 0, never trained), and
    the next turn is sampled on the whole episode so far: its log-probs are vLLM's teacher-forced
    log-probs of the same tokens after the prompt, the first turn and the observation."""
    pytest.importorskip("vllm")
    import numpy as np

    from asyncgrpo.contract import Ticket
    from asyncgrpo.envs import EpisodeRules
    from asyncgrpo.envs.base import EnvironmentSpec, EnvStep
    from asyncgrpo.envs.calls import EnvCalls
    from asyncgrpo.rollout.engine import VLLMEngine
    from asyncgrpo.rollout.episodes import EpisodeRunner, EpisodeSettings
    from asyncgrpo.rollout.running import Admitted
    from asyncgrpo.rollout.stats import GeneratorStats
    from asyncgrpo.tasks import Problem

    class Plus:
        """Answers every call with "+" and ends the episode at its second call."""

        def __init__(self) -> None:
            self.calls = 0

        def reset(self, problem):
            return ""

        def step(self, action):
            self.calls += 1
            return EnvStep(observation="+", done=self.calls == 2)

        def close(self):
            pass

    stops = tuple("0123456789abcdefghijklmnopqrstuvwxyz")
    engine = VLLMEngine(str(model_dir), seed=0, max_model_len=32, dtype="float32", kv_cache_gib=0.25,
                        gpu_memory_utilization=0.3, max_running_seqs=64, prefix_caching=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine.label_version(0)
    runner = EpisodeRunner(engine, tokenizer, EnvironmentSpec("plus", Plus, stops),
                           EnvCalls(threads=2, timeout_s=30.0, latency_s=0.0),
                           EpisodeSettings(samples_per_prompt=2, max_new_tokens=20, temperature=1.0, context_tokens=32,
                                           env=EpisodeRules(max_turns=4, on_error="zero", threads=2, timeout_s=30.0,
                                                            latency_s=0.0)), GeneratorStats())
    for position, prompt in enumerate(PROMPTS * 2):
        runner.start(Admitted(Ticket(position, position), Problem(position, prompt, ""), tokenizer(prompt).input_ids, 0))
    groups = []
    for _ in range(400):
        if runner.engine_busy:
            runner.step_engine()
        else:
            runner.collect_env(wait_s=0.1)
        groups += runner.take_finished()
        if not runner:
            break
    episodes = [episode for group in groups for episode in group.episodes]
    assert len(episodes) == 8 and all(e.done for e in episodes)
    plus = tokenizer("+", add_special_tokens=False).input_ids
    continued = [e for e in episodes if e.turns >= 2]
    assert continued, "no episode reached a second turn"
    for episode in continued:
        first_end = episode.policy.index(0)  # the first observation follows the first turn
        assert tokenizer.decode(episode.tokens[:first_end])[-1] in stops  # the turn ended at a stop text, kept
        assert episode.tokens[first_end:first_end + len(plus)] == plus
        # The rest was sampled on the whole episode so far: teacher-forced log-probs agree.
        sequence = episode.prompt + episode.tokens
        forced = engine.sequence_logprobs([sequence], temperature=1.0)[0][len(episode.prompt) - 1:]
        policy = np.asarray(episode.policy, bool)
        np.testing.assert_allclose(np.asarray(episode.logprobs)[policy], forced[policy], atol=LOGPROB_TOLERANCE)
    del engine
    gc.collect()
