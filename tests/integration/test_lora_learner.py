"""LoRA in the learner under FSDP2 (gloo, one rank, in-process) on the tiny model: a few steps move
the adapters and leave the base; a checkpoint resumes bit-exactly; the export is PEFT's adapter
directory, and its merged model is what the learner pushes."""

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from learner_fixtures import (RESUME_LOSS_KEYS, full_grads, full_params, make_model_dir, max_abs_diff, rank_main,
                              step_groups, train_each)

from asyncgrpo.config import load
from asyncgrpo.learner import lora
from asyncgrpo.learner.export import checkpoint_weights, export_checkpoint
from asyncgrpo.learner.learner import Learner
from asyncgrpo.learner.rendezvous import spawner_store

pytestmark = pytest.mark.slow

# Rank 8 on every linear layer, dropout, a KL term against the adapters-off base, warm-up then cosine:
# Adam's moments, the schedule, the dropout's RNG and the reference must all survive a resume.
OVERRIDES = ["learner.lora.rank=8", "learner.lora.alpha=16", "learner.lora.dropout=0.1", "learner.warmup_steps=2",
             "learner.lr_schedule=cosine", "train.max_steps=6", "learner.lr=1e-2", "learner.weight_decay=0.1",
             "algo.kl.enabled=true", "algo.kl.coef=0.1", "learner.micro_batch_tokens=24"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


def test_lora_steps_move_the_adapters_only_and_resume_bit_exactly(model_dir, tmp_path):
    batches = step_groups(6)
    straight = Learner.from_config(load(OVERRIDES), model_dir)
    try:
        start = full_params(straight)
        optimized = {id(p) for group in straight.policy.optimizer.param_groups for p in group["params"]}
        assert optimized == {id(p) for name, p in straight.policy.model.named_parameters() if lora.is_adapter_name(name)}
        straight_metrics = train_each(straight, batches)
        straight_params = full_params(straight)
        pushed = dict(straight.policy.full_state_dict())
        straight.export_hf(tmp_path / "export")  # the end of a run: the merged model, and export/adapter
    finally:
        straight.close()
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert exported.keys() == pushed.keys() and all(torch.equal(exported[n], pushed[n]) for n in pushed)
    assert (tmp_path / "export" / "adapter" / lora.ADAPTER_WEIGHTS).is_file()
    assert straight_metrics[-1]["loss/kl"] > 0
    for name, value in straight_params.items():
        assert torch.equal(value, start[name]) != lora.is_adapter_name(name), name
    # What a push carries: the base's names, the adapted weights merged.
    q = "model.layers.0.self_attn.q_proj"
    assert f"{q}.lora_A.weight" not in pushed and not torch.equal(pushed[f"{q}.weight"], start[f"{q}.weight"])

    first = Learner.from_config(load(OVERRIDES), model_dir)
    try:
        first_metrics = train_each(first, batches[:3])
        saved = Path(first.save_checkpoint(tmp_path / "run" / "checkpoints"))
        first_pushed = dict(first.policy.full_state_dict())
    finally:
        first.close()
    # The checkpoint holds the adapters (and their optimizer state) only: the base is the model directory.
    assert all(lora.is_adapter_name(name) for name in checkpoint_weights(saved))
    resumed = Learner.from_config(load(OVERRIDES), model_dir)
    try:
        resumed.load_checkpoint(saved)
        resumed_metrics = train_each(resumed, batches[3:])
        resumed_params = full_params(resumed)
        with pytest.raises(lora.LoraError, match="other settings"):
            Learner.load_checkpoint(_with_rank(resumed, 4), saved)
    finally:
        resumed.close()
    for got, want in zip(first_metrics + resumed_metrics, straight_metrics):
        for key in RESUME_LOSS_KEYS:
            assert got[key] == want[key], key
    for name, value in resumed_params.items():
        assert torch.equal(value, straight_params[name]), name

    # The export of the checkpoint: PEFT's adapter directory, and the merged model of step 3.
    export_checkpoint(saved, tmp_path / "adapter", merged=tmp_path / "merged")
    assert (tmp_path / "adapter" / lora.ADAPTER_CONFIG).is_file()
    adapter = load_file(str(tmp_path / "adapter" / lora.ADAPTER_WEIGHTS))
    assert f"base_model.model.{q}.lora_A.weight" in adapter and len(adapter) == 2 * 2 * 7
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    for name, value in first_pushed.items():  # the merged model is what the learner pushed at step 3
        torch.testing.assert_close(merged[name], value, rtol=0, atol=1e-6)


def _with_rank(learner, rank):
    """The learner with another learner.lora.rank in its config (to check the resume refusal)."""
    learner.cfg = load([o for o in OVERRIDES if not o.startswith("learner.lora.rank")] + [f"learner.lora.rank={rank}"])
    return learner


def test_two_lora_ranks_match_one(model_dir, tmp_path):
    """FSDP2 shards each decoder layer's frozen base and its adapters in one unit: the adapters'
    gradients, summed over two ranks, and so the step, equal one rank's."""
    overrides = [o for o in OVERRIDES if "dropout" not in o] + ["learner.grad_clip_norm=100"]  # no RNG, no clip
    store = spawner_store(timedelta(seconds=120))  # held until the ranks are done
    mp.start_processes(rank_main, args=(2, store.port, model_dir, [("lora2", overrides)], 2, str(tmp_path), 0), nprocs=2,
                       join=True, start_method="spawn")
    two = torch.load(tmp_path / "lora2.pt")
    one = Learner.from_config(load(overrides), model_dir)
    try:
        metrics = [one.train_on(groups) for groups in step_groups(2)]
        params, grads = full_params(one), full_grads(one)
    finally:
        one.close()
    assert grads.keys() == two["grads"].keys() and all(lora.is_adapter_name(name) for name in grads)
    for got, want in zip(two["metrics"], metrics):
        for key in RESUME_LOSS_KEYS:
            assert got[key] == pytest.approx(want[key], abs=1e-5, rel=1e-5), key
    assert max_abs_diff(two["grads"], grads) < 1e-5
    assert max_abs_diff(two["params"], params) < 1e-4
