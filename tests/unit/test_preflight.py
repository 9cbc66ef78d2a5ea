"""`asyncgrpo train ... check=true` on every preset, with model.path pointed at a local directory of
the preset's model shape (config and tokenizer only: the check needs no weights), and the
one-line refusals of settings that cannot work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from asyncgrpo.cli import main
from asyncgrpo.config import load
from asyncgrpo.models.bpe import train_tokenizer
from asyncgrpo.models.shapes import SHAPES, qwen2_config
from asyncgrpo.driver.preflight import (PreflightError, check_shared_memory, kv_cache_plan, memory_estimate,
                                        merge_base_bytes)
from asyncgrpo.schema import CONFIG_DIR

SAMPLE = Path(__file__).resolve().parent.parent / "data" / "gsm8k_sample.jsonl"
# The model each preset is written for (None: the embedded tiny model). A new preset must be added.
PRESET_SHAPES = {"default": None, "longtail": None, "calculator": None, "guess": None, "gsm8k_qwen05b_1gpu": "qwen2.5-0.5b", "qwen7b_8gpu_judge": "qwen2.5-7b"}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(300, seed=0)


def shape_dir(directory: Path, shape: str, tokenizer) -> Path:
    config = qwen2_config(SHAPES[shape], eos_token_id=tokenizer.eos_token_id)
    config.architectures = ["Qwen2ForCausalLM"]  # what saving the model would record
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def run_check(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["train", *args, "check=true"])
    out, err = capsys.readouterr()
    return code, out, err


def test_every_preset_has_a_model_shape():
    assert {p.stem for p in CONFIG_DIR.glob("*.yaml")} == set(PRESET_SHAPES)


@pytest.mark.parametrize("preset", sorted(PRESET_SHAPES))
def test_every_preset_passes_the_check_with_a_model_of_its_shape(preset, tmp_path, tokenizer, capsys,
                                                                 models_endpoint, monkeypatch):
    shape = PRESET_SHAPES[preset]
    overrides = [f"model.path={shape_dir(tmp_path, shape, tokenizer)}"] if shape else []
    # The weight slots of a 7B model outgrow this machine's disks (CI's has 24 GiB free); the presets'
    # machines have the room, so the check sees 1 TiB free (its refusal is tested below).
    overrides.append(f"weights.shm_dir={tmp_path}")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1 << 40, 0, 1 << 40))
    if load([], config_name=preset).data.train_files:  # the check reads them: a local sample stands in
        overrides += [f"data.train_files=[{SAMPLE}]", f"data.eval_files=[{SAMPLE}]"]
    if "judge" in preset:  # the check probes the judge: a local one, with the key the preset names
        overrides.append(f"reward.judge.base_url={models_endpoint.base_url}")
        monkeypatch.setenv("JUDGE_API_KEY", "sekrit")
    code, out, err = run_check(capsys, "--config-name", preset, *overrides, f"run_dir={tmp_path}/run")
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    cfg = load(overrides, config_name=preset)
    assert report["push"]["chunks_per_push"] >= 1
    assert report["push"]["largest_tensor_bytes"] <= report["push"]["bytes_per_push"]
    assert report["kv_cache"]["tokens_held"] >= report["kv_cache"]["tokens_needed_per_call"]
    if shape:
        assert report["model"]["vocab_size"] == SHAPES[shape].vocab_size
        # The largest tensor of a real vocabulary is larger than a message; it is split.
        assert report["push"]["largest_tensor_bytes"] > cfg.weights.chunk_bytes
        assert report["push"]["chunks_per_push"] > report["push"]["bytes_per_push"] // cfg.wire.max_message_bytes


def test_the_05b_shape_fits_this_machine_with_the_kl_reference_off(tmp_path, tokenizer, capsys):
    model = shape_dir(tmp_path, "qwen2.5-0.5b", tokenizer)
    code, out, err = run_check(capsys, f"model.path={model}", "device=cpu", "model.max_positions=512",
                               "rollout.max_new_tokens=256", "rollout.kv_cache_gib=1", "rollout.groups_per_call=2",
                               "learner.micro_batch_tokens=2048", "task.name=gsm8k", f"data.train_files=[{SAMPLE}]",
                               f"run_dir={tmp_path}/run")
    assert code == 0, err
    memory = json.loads(out.strip().splitlines()[-1])["memory_gib"]
    assert memory["total_gib"] < 24


def test_a_model_directory_without_a_tokenizer_is_one_line(tmp_path, capsys):
    config = qwen2_config(SHAPES["tiny-fullvocab"])
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(tmp_path)
    code, _, err = run_check(capsys, f"model.path={tmp_path}", f"run_dir={tmp_path}/run")
    assert code == 2
    assert err.count("\n") == 1 and "no tokenizer" in err


def test_a_context_longer_than_the_model_is_one_line(tmp_path, tokenizer, capsys):
    model = shape_dir(tmp_path, "tiny-fullvocab", tokenizer)
    code, _, err = run_check(capsys, f"model.path={model}", "model.max_positions=4096", f"run_dir={tmp_path}/run")
    assert code == 2 and err.count("\n") == 1 and "2048 positions" in err


def test_a_kv_cache_too_small_for_one_call_names_the_key(tmp_path, tokenizer, capsys):
    model = shape_dir(tmp_path, "tiny-fullvocab", tokenizer)
    code, _, err = run_check(capsys, f"model.path={model}", "model.max_positions=2048", "rollout.kv_cache_gib=0.01",
                             f"run_dir={tmp_path}/run")
    assert code == 2 and err.count("\n") == 1 and "rollout.kv_cache_gib=0.01" in err


def test_a_model_whose_head_dim_vllm_cpu_attention_cannot_run_is_refused_by_the_check_on_cpu(tmp_path, tokenizer,
                                                                                             capsys):
    model = shape_dir(tmp_path / "model", "tiny-fullvocab", tokenizer)
    config = json.loads((model / "config.json").read_text())
    config["num_attention_heads"] = config["hidden_size"] // 16
    config["num_key_value_heads"] = config["num_attention_heads"]
    (model / "config.json").write_text(json.dumps(config))
    code, _, err = run_check(capsys, f"model.path={model}", "device=cpu", "model.max_positions=2048",
                             f"run_dir={tmp_path}/run")
    assert code == 2 and err.count("\n") == 1 and "head_dim 16: vLLM's CPU attention runs only" in err


def test_kv_cache_arithmetic():
    cfg = load(["model.max_positions=100", "rollout.samples_per_prompt=4", "rollout.groups_per_call=2",
                "rollout.dtype=bfloat16", "rollout.kv_cache_gib=0.0001"])
    with pytest.raises(PreflightError, match="need 800 "):
        kv_cache_plan(cfg, num_layers=2, num_kv_heads=2, head_dim=64)
    cfg.rollout.kv_cache_gib = 1.0
    plan = kv_cache_plan(cfg, num_layers=2, num_kv_heads=2, head_dim=64)
    assert plan["bytes_per_token"] == 2 * 2 * 2 * 64 * 2
    assert plan["tokens_held"] == (1 << 30) // plan["bytes_per_token"]


def test_memory_grows_with_the_kl_reference_and_shrinks_with_ranks():
    base = load(["learner.micro_batch_tokens=1024"])
    plain = memory_estimate(base, 10**8, 1000, 4 * 10**8, "zmq")
    with_kl = memory_estimate(load(["learner.micro_batch_tokens=1024", "algo.kl.enabled=true"]), 10**8, 1000,
                              4 * 10**8, "zmq")
    two_ranks = memory_estimate(load(["learner.micro_batch_tokens=1024", "learner.world_size=2"]), 10**8, 1000,
                                4 * 10**8, "zmq")
    assert with_kl["learner_rank_gib"] > plain["learner_rank_gib"] > two_ranks["learner_rank_gib"]


def test_shared_memory_slots_are_counted_once_not_per_generator():
    cfg = load(["learner.micro_batch_tokens=1024", "rollout.num_generators=2"])
    zmq = memory_estimate(cfg, 10**8, 1000, 4 * 10**8, "zmq")
    shm = memory_estimate(cfg, 10**8, 1000, 4 * 10**8, "shm")
    assert shm["shared_memory_gib"] == pytest.approx(2 * 4 * 10**8 / 2**30)
    assert shm["generator_gib"] < zmq["generator_gib"] and shm["learner_rank_gib"] < zmq["learner_rank_gib"]
    assert shm["total_gib"] < zmq["total_gib"]  # two slots in all against a push's buffers in every actor


def test_too_little_shared_memory_for_the_weight_slots_is_refused_by_the_preflights_check(monkeypatch, tmp_path):
    cfg = load([f"weights.shm_dir={tmp_path}"])
    check_shared_memory(cfg, 1024)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1 << 30, 1 << 30, 0))
    with pytest.raises(PreflightError, match="set weights.shm_dir or weights.backend=zmq"):
        check_shared_memory(cfg, 1024)
    with pytest.raises(PreflightError, match="is not a directory"):
        check_shared_memory(load([f"weights.shm_dir={tmp_path}/missing"]), 1024)


def test_a_lora_target_the_model_lacks_or_a_rank_wider_than_its_layers_is_one_line(tmp_path, tokenizer, capsys):
    model = shape_dir(tmp_path, "tiny-fullvocab", tokenizer)
    common = [f"model.path={model}", "model.max_positions=1024", f"run_dir={tmp_path}/run"]
    code, _, err = run_check(capsys, *common, "learner.lora.rank=8", "learner.lora.target_modules=[q_proj,qkv]")
    assert code == 2 and err.count("\n") == 1 and "learner.lora.target_modules names 'qkv'" in err
    code, _, err = run_check(capsys, *common, "learner.lora.rank=100000")
    assert code == 2 and err.count("\n") == 1 and "learner.lora.rank=100000 is larger than" in err
    code, out, err = run_check(capsys, *common, "learner.lora.rank=8")
    assert code == 0 and '"lora": {"rank": 8' in out, err


def test_a_lora_runs_push_plan_is_its_adapters_unless_it_pushes_merged_weights(tmp_path, tokenizer, capsys):
    model = shape_dir(tmp_path, "tiny-fullvocab", tokenizer)
    common = [f"model.path={model}", "model.max_positions=1024", f"run_dir={tmp_path}/run"]
    reports = {}
    for name, extra in (("full", []), ("adapter", ["learner.lora.rank=8"]),
                        ("merged", ["learner.lora.rank=8", "weights.lora_push=merged"])):
        code, out, err = run_check(capsys, *common, *extra)
        assert code == 0, err
        reports[name] = json.loads(out[out.index("{"):])
    adapter = reports["adapter"]["push"]
    assert adapter["tensors"] == 2 * reports["adapter"]["lora"]["layers"]
    assert adapter["largest_tensor"].endswith((".lora_A.weight", ".lora_B.weight"))
    assert reports["merged"]["push"] == reports["full"]["push"]
    assert adapter["bytes_per_push"] * 10 < reports["full"]["push"]["bytes_per_push"]


def test_lora_needs_no_optimizer_state_or_reference_copy_for_the_base():
    full = memory_estimate(load(["learner.micro_batch_tokens=1024", "algo.kl.enabled=true"]), 10**8, 1000,
                           4 * 10**8, "zmq")
    adapters = memory_estimate(load(["learner.micro_batch_tokens=1024", "algo.kl.enabled=true",
                                     "learner.lora.rank=8"]), 10**8, 1000, 4 * 10**8, "zmq")
    # fp32 weights + gradients + two moments + the reference, against the frozen fp32 weights alone.
    assert full["learner_rank_gib"] - adapters["learner_rank_gib"] == pytest.approx((12 + 4) * 10**8 / 2**30)


def test_a_generator_merging_adapter_pushes_is_estimated_with_the_base_of_the_targeted_layers_and_vllm_lora_without(tmp_path, tokenizer,
                                                                                              capsys):
    from asyncgrpo.learner.lora import AdapterLayout

    layout = AdapterLayout({"a.q_proj": (64, 32), "a.v_proj": (16, 32)}, rank=8, scaling=2.0)
    assert merge_base_bytes(layout, "float32") == (64 * 32 + 16 * 32) * 4
    assert merge_base_bytes(layout, "bfloat16") == (64 * 32 + 16 * 32) * 2
    assert merge_base_bytes(None, "float32") == 0
    cfg = load(["learner.micro_batch_tokens=1024"])
    plain = memory_estimate(cfg, 10**8, 1000, 4 * 10**8, "zmq")
    merging = memory_estimate(cfg, 10**8, 1000, 4 * 10**8, "zmq", merge_base_bytes=3 * 2**30)
    assert merging["generator_gib"] - plain["generator_gib"] == pytest.approx(3.0)
    assert merging["total_gib"] - plain["total_gib"] == pytest.approx(3.0 * cfg.rollout.num_generators)
    model = shape_dir(tmp_path, "tiny-fullvocab", tokenizer)
    common = [f"model.path={model}", "model.max_positions=1024", f"run_dir={tmp_path}/run"]
    reports = {}
    for name, extra in (("adapter", ["learner.lora.rank=8"]),
                        ("merged", ["learner.lora.rank=8", "weights.lora_push=merged"]),
                        ("vllm_lora", ["learner.lora.rank=8", "rollout.lora_apply=vllm"])):
        code, out, err = run_check(capsys, *common, *extra)
        assert code == 0, err
        reports[name] = json.loads(out[out.index("{"):])["memory_gib"]
    assert reports["merged"]["merge_base_gib"] == reports["vllm_lora"]["merge_base_gib"] == 0
    assert reports["adapter"]["merge_base_gib"] > 0
    assert reports["adapter"]["generator_gib"] - reports["merged"]["generator_gib"] == pytest.approx(
        reports["adapter"]["merge_base_gib"])


def test_the_push_plan_counts_the_dtype_its_backend_pushes_in():
    from asyncgrpo.driver.preflight import push_plan

    spec = [("w", (4, 4), torch.float32)]
    zmq = push_plan(load(["rollout.dtype=bfloat16", "weights.backend=zmq"]), spec)
    nccl = push_plan(load(["rollout.dtype=bfloat16", "weights.backend=nccl"]), spec)
    assert (zmq["wire_dtype"], zmq["bytes_per_push"]) == ("bfloat16", 32)
    assert (nccl["wire_dtype"], nccl["bytes_per_push"]) == ("float32", 64)  # nccl broadcasts float32


# ----------------------------------------------------------------------------- the weights' files


def test_check_names_a_model_without_weights_that_a_run_would_refuse(tmp_path, tokenizer, capsys, monkeypatch):
    from asyncgrpo.models.check import ModelDirError
    from asyncgrpo.driver.preflight import preflight

    model = shape_dir(tmp_path / "m", "tiny-fullvocab", tokenizer)
    code, out, _ = run_check(capsys, f"model.path={model}", "model.max_positions=2048", "rollout.kv_cache_gib=1")
    assert code == 0 and "weights: no weights (*.safetensors or pytorch_model*.bin) (a run needs them)" in out
    cfg = load([f"model.path={model}", "model.max_positions=2048", "rollout.kv_cache_gib=1"])
    with pytest.raises(ModelDirError, match=r"no weights \(\*.safetensors or pytorch_model\*.bin\)$"):
        preflight(cfg, str(model))


def test_weights_are_found_by_their_files_and_a_cut_or_foreign_safetensors_file_is_named(tmp_path):
    from safetensors.torch import save_file

    from asyncgrpo.models.check import weights_error

    assert weights_error(tmp_path) == "no weights (*.safetensors or pytorch_model*.bin)"
    save_file({"w": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    assert weights_error(tmp_path) is None
    whole = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(whole[:20])  # cut inside its header
    assert weights_error(tmp_path).startswith("model.safetensors: not a safetensors file (20 bytes")
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 8 + b"junk")
    assert weights_error(tmp_path).startswith("model.safetensors: not a safetensors file")
    (tmp_path / "model.safetensors").write_bytes(whole)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": "model.safetensors", "v": "model-00002-of-00002.safetensors"}}))
    assert weights_error(tmp_path) == ("model.safetensors.index.json names 1 missing shard(s), "
                                       "model-00002-of-00002.safetensors first")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": 5}}))
    assert weights_error(tmp_path) == "model.safetensors.index.json: its weight_map must name shard files"
    (tmp_path / "model.safetensors.index.json").unlink()
    (tmp_path / "model.safetensors").write_bytes((200_000_000).to_bytes(8, "little") + b"{}")  # a foreign length
    assert weights_error(tmp_path).startswith("model.safetensors: not a safetensors file")
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    assert weights_error(tmp_path) is None


@pytest.mark.parametrize(("template", "said"), [
    ("", "tokenizer.chat_template is not set"),  # the embedded model has none of its own
    ("{% if %}", "TemplateSyntaxError"),
])
def test_an_agent_run_whose_chat_template_cannot_render_a_request_is_refused_by_the_check(
        tmp_path, capsys, monkeypatch, template, said):
    (tmp_path / "my_agent.py").write_text("def agent(problem, base_url, api_key):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = run_check(capsys, "env.name=agent", "env.agent.fn=my_agent:agent",
                             f"env.agent.chat_template='{template}'")
    assert code == 2 and "env.name=agent: cannot render the messages with the chat template" in err and said in err
    code, _, err = run_check(capsys, "env.name=agent", "env.agent.fn=my_agent:agent",
                             "env.agent.chat_template='{% for m in messages %}{{ m.content }}{% endfor %}'")
    assert code == 0, err
