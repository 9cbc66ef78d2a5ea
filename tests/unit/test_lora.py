"""LoRA on the learner's policy (asyncgrpo/learner/lora.py), in-process on the tiny model (no FSDP):
the layer's algebra, merged weights, what trains, the KL reference with adapters off, PEFT's
layout, and the one-line refusals of settings and checkpoints that cannot work."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncgrpo.config import load
from asyncgrpo.learner import lora
from asyncgrpo.learner.batch import collate
from asyncgrpo.learner.policy import Policy, _param_groups
from asyncgrpo.learner.update import update
from asyncgrpo.models.tiny import TinyModelSpec, build_model, save_model
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.schema import ConfigError, LoraConfig

from test_update_modes import groups

TOKENS = torch.tensor([[5, 9, 17, 3, 22, 40, 8, 11]])


def tiny(seed: int = 0) -> nn.Module:
    return build_model(TinyModelSpec.from_config(load([]).model), build_char_tokenizer(), seed=seed)


def adapted(rank: int = 4, targets: list[str] | None = None, randomize_b: bool = True) -> nn.Module:
    """The tiny model with adapters; B drawn at random (else the adapters do nothing yet)."""
    torch.manual_seed(0)
    model = tiny()
    lora.add_adapters(model, LoraConfig(rank=rank, alpha=8.0, target_modules=targets or ["all-linear"]))
    if randomize_b:
        with torch.no_grad():
            for module in lora.lora_modules(model).values():
                module.lora_B.weight.normal_(0, 0.1)
    return model.eval()


def policy_of(model: nn.Module, with_reference: bool = False) -> Policy:
    optimizer = torch.optim.AdamW(_param_groups(model, 0.0), lr=1e-2)
    return Policy(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
                  tiny() if with_reference else None, torch.device("cpu"), torch.device("cpu"), rank=0, temperature=1.0)


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS, use_cache=False).logits


def test_a_lora_layer_with_zero_b_computes_its_base_layer():
    torch.manual_seed(0)
    base = nn.Linear(12, 7)
    x = torch.randn(3, 12)
    want = base(x)
    layer = lora.LoraLinear(base, rank=4, alpha=8.0, dropout=0.0)
    assert layer.lora_A.weight.abs().sum() > 0  # A starts random, B at zero: the update is zero
    assert torch.equal(layer(x), want)


def test_a_lora_layer_adds_scale_times_b_a():
    torch.manual_seed(0)
    layer = lora.LoraLinear(nn.Linear(12, 7), rank=4, alpha=8.0, dropout=0.0)
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(3, 12)
    merged = layer.merge(layer.weight, layer.lora_A.weight, layer.lora_B.weight)
    torch.testing.assert_close(layer(x), x @ merged.T + layer.bias)
    assert layer.scaling == 2.0


def test_merged_weights_give_the_adapter_forwards_logits():
    model = adapted()
    named = dict(policy_of(model).full_state_dict())
    plain = tiny(seed=1)
    assert list(named) == [name for name, _ in plain.state_dict().items() if name in dict(plain.named_parameters())]
    plain.load_state_dict(named, strict=False)
    torch.testing.assert_close(logits(plain.eval()), logits(model), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits(tiny()), logits(model), atol=1e-3)  # the adapters do change the model


def test_only_the_adapters_require_grad_and_reach_the_optimizer():
    model = adapted(targets=["q_proj", "v_proj"])
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_adapter_name(name) for name in trainable)
    assert all(name.split(".")[-3] in ("q_proj", "v_proj") for name in trainable)
    in_optimizer = {id(p) for group in policy_of(model).optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for name, p in model.named_parameters() if name in trainable}


def test_adapters_off_gives_the_base_models_logits_and_the_kl_reference():
    model = adapted().train()
    with lora.adapters_off(model):
        torch.testing.assert_close(logits(model), logits(tiny()))
    assert model.training  # restored
    assert all(module.adapters_on for module in lora.lora_modules(model).values())
    cfg = load([])
    batch = collate(groups(), build_char_tokenizer().pad_token_id)
    base_policy = policy_of(tiny())
    torch.testing.assert_close(policy_of(model).reference_logprobs(batch), base_policy.logprobs(batch).detach())


def test_an_update_under_lora_moves_the_adapters_and_leaves_the_base():
    cfg = load(["learner.warmup_steps=0", "learner.lora.rank=4", "algo.kl.enabled=true", "algo.kl.coef=0.5"])
    model = adapted(randomize_b=False).train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    policy = policy_of(model)
    batch = collate(groups(), build_char_tokenizer().pad_token_id)
    for _ in range(2):
        metrics = update(policy, batch, cfg, rank=0, world_size=1, max_new_tokens=cfg.rollout.max_new_tokens)
    assert metrics["loss/kl"] > 0  # the reference is the base: once B moves, the policy differs from it
    for name, p in model.named_parameters():
        moved = not torch.equal(p, before[name])
        assert moved == (name.endswith(".lora_B.weight") or name.endswith(".lora_A.weight")), name


def test_adapter_names_shapes_and_config_follow_peft():
    model = adapted(rank=4, targets=["q_proj", "down_proj"])
    named = dict(policy_of(model).adapter_state_dict())
    assert named["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
    assert named["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (64, 4)
    assert len(named) == 2 * 2 * 2  # two layers, two targets, A and B
    config = lora.adapter_config(LoraConfig(rank=4, alpha=8.0), list(lora.lora_modules(model)), "/models/base")
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and config["bias"] == "none"
    assert config["r"] == 4 and config["lora_alpha"] == 8 and isinstance(config["lora_alpha"], int)
    assert config["target_modules"] == ["down_proj", "q_proj"]
    assert config["base_model_name_or_path"] == "/models/base"


def test_vllm_reads_the_adapter_config_and_names():
    pytest.importorskip("vllm")
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    model = adapted(rank=4)
    helper = PEFTHelper.from_dict(lora.adapter_config(LoraConfig(rank=4, alpha=8.0), list(lora.lora_modules(model)), "b"))
    assert helper.r == 4 and helper.vllm_lora_scaling_factor == 2.0
    assert parse_fine_tuned_lora_name("base_model.model.model.layers.0.mlp.up_proj.lora_A.weight") == (
        "model.layers.0.mlp.up_proj", True)
    assert parse_fine_tuned_lora_name("base_model.model.lm_head.lora_B.weight") == ("lm_head", False)


@pytest.mark.parametrize("override, key", [
    ("learner.lora.rank=-1", "learner.lora.rank"),
    ("learner.lora.alpha=0", "learner.lora.alpha"),
    ("learner.lora.dropout=1.0", "learner.lora.dropout"),
    ("learner.lora.target_modules=[]", "learner.lora.target_modules"),
])
def test_impossible_lora_numbers_are_refused_in_one_line(override, key):
    with pytest.raises(ConfigError, match=key) as err:
        load([override])
    assert "\n" not in str(err.value)


def test_a_target_the_model_lacks_or_a_rank_wider_than_a_layer_is_refused(tmp_path):
    tokenizer = build_char_tokenizer()
    save_model(tiny(), tokenizer, tmp_path)
    assert lora.check_model(LoraConfig(rank=0), str(tmp_path)) == []
    assert len(lora.check_model(LoraConfig(rank=8), str(tmp_path))) == 2 * 7
    with pytest.raises(lora.LoraError, match="'qkv_proj', which no linear layer"):
        lora.check_model(LoraConfig(rank=8, target_modules=["q_proj", "qkv_proj"]), str(tmp_path))
    with pytest.raises(lora.LoraError, match="rank=65 is larger than .*q_proj .*at most 64"):
        lora.check_model(LoraConfig(rank=65, target_modules=["q_proj"]), str(tmp_path))


def test_a_resume_onto_another_base_or_adapter_is_refused(tmp_path):
    tokenizer = build_char_tokenizer()
    save_model(tiny(), tokenizer, tmp_path / "base")
    save_model(tiny(seed=1), tokenizer, tmp_path / "other")
    mine = LoraConfig(rank=8)
    states = {"lora": lora.adapter_record(mine, tmp_path / "base")}
    lora.check_adapter_resume(states, mine, tmp_path / "base", "ckpt")  # the same: accepted
    lora.check_adapter_resume({}, LoraConfig(), tmp_path / "base", "ckpt")  # full fine-tuning both
    with pytest.raises(lora.LoraError, match="another base model"):
        lora.check_adapter_resume(states, mine, tmp_path / "other", "ckpt")
    with pytest.raises(lora.LoraError, match=r"learner.lora.rank=16 \(the checkpoint's: 8\)"):
        lora.check_adapter_resume(states, LoraConfig(rank=16), tmp_path / "base", "ckpt")
    with pytest.raises(lora.LoraError, match="written by full fine-tuning"):
        lora.check_adapter_resume({}, mine, tmp_path / "base", "ckpt")
    with pytest.raises(lora.LoraError, match="holds LoRA adapters"):
        lora.check_adapter_resume(states, LoraConfig(), tmp_path / "base", "ckpt")


def test_the_drivers_adapter_check_refuses_a_lora_checkpoint_of_another_base(tmp_path):
    from asyncgrpo.driver.prepare import check_adapter
    from asyncgrpo.learner.resume import ResumeRefused

    tokenizer = build_char_tokenizer()
    save_model(tiny(), tokenizer, tmp_path / "base")
    save_model(tiny(seed=1), tokenizer, tmp_path / "other")
    resume = {"path": "ckpt", "states": {"lora": lora.adapter_record(LoraConfig(rank=8), tmp_path / "base")}}
    check_adapter(load(["learner.lora.rank=8"]), resume, str(tmp_path / "base"))
    with pytest.raises(ResumeRefused, match="another base model"):
        check_adapter(load(["learner.lora.rank=8"]), resume, str(tmp_path / "other"))


def test_the_lm_head_is_adapted_only_when_named_and_its_merged_weights_give_the_adapter_forwards_logits():
    assert "lm_head" not in lora.lora_modules(adapted(targets=["all-linear"]))
    model = adapted(rank=4, targets=["all-linear", "lm_head"])
    assert list(lora.lora_modules(model))[-1] == "lm_head" and len(lora.lora_modules(model)) == 2 * 7 + 1
    policy = policy_of(model)
    named = dict(policy.adapter_state_dict())
    assert named["base_model.model.lm_head.lora_A.weight"].shape == (4, 64)
    assert named["base_model.model.lm_head.lora_B.weight"].shape == (61, 4)
    plain = tiny(seed=1)
    plain.load_state_dict(dict(policy.full_state_dict()), strict=False)
    torch.testing.assert_close(logits(plain.eval()), logits(model), atol=1e-5, rtol=1e-5)
    only_head = adapted(rank=4, targets=["lm_head"])
    assert list(lora.lora_modules(only_head)) == ["lm_head"]
    assert not torch.allclose(logits(only_head), logits(tiny()), atol=1e-3)  # the head's adapter acts
    with lora.adapters_off(only_head):
        torch.testing.assert_close(logits(only_head), logits(tiny()))
    config = lora.adapter_config(LoraConfig(rank=4), list(lora.lora_modules(model)), "b")
    assert "lm_head" in config["target_modules"]


def test_an_lm_head_narrower_than_the_rank_or_tied_to_the_embeddings_is_refused():
    with pytest.raises(lora.LoraError, match=r"rank=62 is larger than lm_head \(61 x 64\) allows: at most 61"):
        lora.resolve_targets(tiny(), LoraConfig(rank=62, target_modules=["all-linear", "lm_head"]))
    assert len(lora.resolve_targets(tiny(), LoraConfig(rank=61, target_modules=["all-linear", "lm_head"]))) == 15
    tied = tiny()
    tied.config.tie_word_embeddings = True
    with pytest.raises(lora.LoraError, match="ties to its input embeddings") as err:
        lora.resolve_targets(tied, LoraConfig(rank=4, target_modules=["lm_head"]))
    assert "\n" not in str(err.value)
    assert len(lora.resolve_targets(tied, LoraConfig(rank=4))) == 2 * 7  # the decoder layers alone still do
