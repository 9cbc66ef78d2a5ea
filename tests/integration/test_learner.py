"""The learner in-process: real FSDP2 over a gloo group of one, real tiny Qwen2."""

import numpy as np
import pytest
import torch

from asyncgrpo.config import load
from asyncgrpo.learner.batch import collate
from asyncgrpo.learner.learner import Learner
from asyncgrpo.learner.update import update
from asyncgrpo.models.tiny import TinyModelSpec, build_model, save_model
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.schema import ModelConfig
from asyncgrpo.wire import ScoredGroup

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    tokenizer = build_char_tokenizer()
    save_model(build_model(TinyModelSpec.from_config(ModelConfig()), tokenizer, seed=0), tokenizer, directory)
    return str(directory)


def fixed_groups(num_groups=4, samples=4, seed=0):
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        lengths = rng.integers(1, 6, size=samples).astype(np.int32)
        total = int(lengths.sum())
        groups.append(ScoredGroup(
            generator_id=0, seq=g, prompt_id=g,
            prompt_tokens=rng.integers(3, 60, size=int(rng.integers(4, 8))).astype(np.int32),
            tokens=rng.integers(1, 60, size=total).astype(np.int32),
            logprobs=-rng.uniform(0.5, 5.0, size=total).astype(np.float32),
            versions=np.zeros(total, dtype=np.int32),
            lengths=lengths,
            rewards=rng.integers(0, 2, size=samples).astype(np.float32),
        ))
    return groups


def one_update(model_dir, *overrides, updates=1):
    """The parameters after `updates` updates on the same batch, and the last update's metrics."""
    cfg = load(["learner.warmup_steps=0", *overrides])
    learner = Learner.from_config(cfg, model_dir)
    try:
        batch = collate(fixed_groups(), learner.pad_id)
        for _ in range(updates):
            metrics = update(learner.policy, batch, cfg, rank=0, world_size=1,
                             max_new_tokens=cfg.rollout.max_new_tokens)
        params = {name: p.full_tensor().detach().clone() for name, p in learner.policy.model.named_parameters()}
    finally:
        learner.close()
    return params, metrics


def test_micro_batch_split_does_not_change_the_update(model_dir):
    reference, reference_metrics = one_update(model_dir, "learner.micro_batch_tokens=0")
    assert reference_metrics["perf/micro_batches"] == 1
    for budget in (12, 40):
        params, metrics = one_update(model_dir, f"learner.micro_batch_tokens={budget}")
        assert metrics["perf/micro_batches"] > 1
        assert metrics["loss/pg"] == pytest.approx(reference_metrics["loss/pg"], abs=1e-6)
        assert metrics["optim/grad_norm"] == pytest.approx(reference_metrics["optim/grad_norm"], rel=1e-5)
        worst = max((params[n] - reference[n]).abs().max().item() for n in reference)
        assert worst < 1e-5, f"budget {budget}: parameters differ by {worst}"


def test_kl_to_reference_is_zero_at_the_reference_and_added_to_the_loss_once_the_policy_moved(model_dir):
    kl = ("algo.kl.enabled=true", "algo.kl.coef=0.5", "algo.kl.kind=k3")
    _, without = one_update(model_dir)
    _, first = one_update(model_dir, *kl)
    # Before the first update the policy equals the reference: k3 is 0 and so is its gradient.
    assert first["loss/kl"] == pytest.approx(0.0, abs=1e-7)
    assert first["loss/total"] == pytest.approx(without["loss/total"], abs=1e-6)
    # After it the policy has moved: the second update's loss is its policy loss plus coef x KL.
    _, second = one_update(model_dir, *kl, updates=2)
    assert second["loss/kl"] > 1e-6
    assert second["loss/total"] == pytest.approx(second["loss/pg"] + 0.5 * second["loss/kl"], rel=1e-4, abs=1e-7)


def test_sequence_logprobs_match_the_training_forward(model_dir):
    cfg = load([])
    learner = Learner.from_config(cfg, model_dir)
    try:
        batch = collate(fixed_groups(num_groups=1, samples=1), learner.pad_id)
        sequence = batch.input_ids[0][batch.attention_mask[0].bool()].tolist()
        probe = learner.sequence_logprobs([sequence])[0]
        with torch.no_grad():
            logits = learner.policy.model(input_ids=batch.input_ids).logits
        from asyncgrpo.learner.batch import completion_logprobs

        expected = completion_logprobs(logits, batch.logit_index, batch.targets, 1.0)[0, : int(batch.mask[0].sum())]
        np.testing.assert_allclose(probe[-expected.numel():], expected.numpy(), atol=1e-5)
    finally:
        learner.close()


def test_policy_entropy_is_the_mean_entropy_of_the_sampling_distribution_over_trained_tokens(model_dir):
    temperature = 0.7
    cfg = load(["learner.warmup_steps=0", f"rollout.temperature={temperature}"])
    learner = Learner.from_config(cfg, model_dir)
    try:
        batch = collate(fixed_groups(), learner.pad_id)
        with torch.no_grad():
            logits = learner.policy.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        rows = logits.gather(1, batch.logit_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).double()
        p = (rows / temperature).softmax(-1)
        per_token = -(p * p.clamp(min=1e-300).log()).sum(-1)
        expected = float((per_token * batch.mask).sum() / batch.mask.sum())
        whole = update(learner.policy, batch, cfg, rank=0, world_size=1, max_new_tokens=cfg.rollout.max_new_tokens)
    finally:
        learner.close()
    assert whole["policy/entropy"] == pytest.approx(expected, rel=1e-4)
    _, split = one_update(model_dir, "learner.micro_batch_tokens=12", f"rollout.temperature={temperature}")
    assert split["perf/micro_batches"] > 1
    assert split["policy/entropy"] == pytest.approx(expected, rel=1e-4)
