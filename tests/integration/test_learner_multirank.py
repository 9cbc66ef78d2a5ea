"""Two learner ranks as real processes (gloo, FSDP2) against one rank, on the same groups.

The update must not depend on the world size or on the micro-batch budget: advantages and loss
denominators come from the whole step (or the whole mini-batch), gradients are summed over ranks.
"""

from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp
from learner_fixtures import (
    full_grads,
    full_params,
    make_model_dir,
    max_abs_diff,
    rank_main,
    step_groups,
)

from asyncgrpo.config import load
from asyncgrpo.learner.batch import collate, micro_batch_plan, rank_shares
from asyncgrpo.learner.learner import Learner
from asyncgrpo.learner.rendezvous import spawner_store

pytestmark = pytest.mark.slow

STEPS = 2  # the second step uses Adam's moments and moves the policy away from the KL reference
# No clipping, so the gradients are compared as computed. Adam divides each gradient by its own
# running magnitude: an element whose gradient is float noise moves by up to lr either way, so
# parameters can agree only to about lr; the gradients themselves are compared tightly.
BASE = ["learner.warmup_steps=0", "learner.lr=1e-4", "learner.weight_decay=0.1", "algo.kl.enabled=true",
        "algo.kl.coef=0.1", "learner.grad_clip_norm=100"]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


def run_one_rank(model_dir, overrides, steps=STEPS):
    learner = Learner.from_config(load(BASE + overrides), model_dir)
    try:
        metrics = [learner.train_on(groups) for groups in step_groups(steps)]
        return metrics, full_params(learner), full_grads(learner)
    finally:
        learner.close()


@pytest.fixture(scope="module")
def two_ranks(model_dir, tmp_path_factory):
    """Budgets 0, 12 and 40 tokens at world size 2 (the last with the reference kept on CPU), and
    two mini-batches (of 3 and 2 groups, split unevenly over the ranks) at budget 12."""
    out = tmp_path_factory.mktemp("ranks")
    runs = [
        ("budget0", BASE + ["learner.micro_batch_tokens=0"]),
        ("budget12", BASE + ["learner.micro_batch_tokens=12"]),
        ("budget40", BASE + ["learner.micro_batch_tokens=40", "algo.kl.reference_on=cpu"]),
        ("mini2", BASE + ["learner.micro_batch_tokens=12", "learner.mini_batches=2"]),
    ]
    store = spawner_store(timedelta(seconds=120))  # held until the ranks are done
    mp.start_processes(rank_main, args=(2, store.port, model_dir, runs, STEPS, str(out), 1), nprocs=2,
                       join=True, start_method="spawn")
    return out, {name: torch.load(out / f"{name}.pt") for name, _ in runs}


def test_world_size_two_matches_one_for_every_micro_batch_budget_and_mini_batch_count(model_dir, two_ranks):
    one_step = run_one_rank(model_dir, [])
    # One rank, one pass per mini-batch: the two-rank split must add up to it.
    references = {"mini2": run_one_rank(model_dir, ["learner.mini_batches=2"])}
    _, results = two_ranks
    report = {}
    for name, result in results.items():
        reference_metrics, reference_params, reference_grads = references.get(name, one_step)
        assert result["metrics"][0]["perf/mini_batches"] == (2 if name == "mini2" else 1)
        for step, (got, want) in enumerate(zip(result["metrics"], reference_metrics)):
            for key in ("loss/total", "loss/pg", "loss/kl", "optim/grad_norm", "loss/clipfrac"):
                assert got[key] == pytest.approx(want[key], abs=TOLERANCE, rel=TOLERANCE), (name, step, key)
            assert got["perf/tokens"] == want["perf/tokens"]
        worst = max_abs_diff(result["params"], reference_params)
        worst_grad = max_abs_diff(result["grads"], reference_grads)
        report[name] = (worst, worst_grad)
        assert worst < TOLERANCE, f"{name}: parameters differ by {worst:.3g}"
        assert worst_grad < 1e-6, f"{name}: gradients differ by {worst_grad:.3g}"
    # After two steps the policy has left the reference: the KL term was live.
    assert one_step[0][1]["loss/kl"] > 0
    # Two optimizer steps a learner step move the policy elsewhere than one: the comparison above could tell.
    assert max_abs_diff(references["mini2"][1], one_step[1]) > 10 * TOLERANCE
    print("world size 2 vs 1, max |difference| (params, last gradients):",
          {k: f"{p:.2e}, {g:.2e}" for k, (p, g) in report.items()})


def test_budgets_split_the_ranks_unevenly():
    """The 12-token budget gives the two ranks different micro-batch counts, so the padding
    micro-batches (loss x 0) that keep FSDP2's collectives in step are exercised above."""
    batch = collate(step_groups(STEPS)[0], pad_id=0)
    lengths = batch.attention_mask.sum(1).tolist()
    shares = rank_shares(batch, 2)
    assert all(shares) and sorted(sum(shares, [])) == list(range(batch.num_samples))
    counts = [len(micro_batch_plan(lengths, rows, 12, True)) for rows in shares]
    assert counts[0] != counts[1], counts


def test_checkpoint_from_two_ranks_resumes_on_one(model_dir, two_ranks):
    """DCP reshards: a checkpoint written by 2 ranks after step 1 continues on 1 rank."""
    out, results = two_ranks
    learner = Learner.from_config(load(BASE + ["learner.micro_batch_tokens=0"]), model_dir)
    try:
        meta = learner.load_checkpoint(out / "checkpoints")
        assert meta["version"] == 1 and meta["world_size"] == 2
        metrics = learner.train_on(step_groups(STEPS)[1])
        params = full_params(learner)
    finally:
        learner.close()
    assert metrics["loss/total"] == pytest.approx(results["budget0"]["metrics"][1]["loss/total"], abs=TOLERANCE)
    worst = max_abs_diff(params, results["budget0"]["params"])
    assert worst < TOLERANCE, worst


def test_activation_checkpointing_does_not_change_the_update(model_dir):
    plain_metrics, plain, _ = run_one_rank(model_dir, [], steps=1)
    ac_metrics, checkpointed, _ = run_one_rank(model_dir, ["learner.activation_checkpointing=true"], steps=1)
    assert ac_metrics[0]["loss/total"] == pytest.approx(plain_metrics[0]["loss/total"], abs=1e-7)
    assert max_abs_diff(checkpointed, plain) < 1e-6
