"""Generator engines kept between runs (rollout.engine_pool): which runs may share an engine, what
the config refuses, and what a study's runs are given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncgrpo.config import load
from asyncgrpo.driver.engine_pool import actor_name, engine_key
from asyncgrpo.schema import ConfigError
from asyncgrpo.study.cluster import cluster_overrides
from asyncgrpo.composition import weights_backend, wire_transport

POOLED = ["ray.address=127.0.0.1:6379", "rollout.engine_pool=study-1"]


def model_dir(tmp_path: Path, name: str, **config: object) -> str:
    directory = tmp_path / name
    directory.mkdir()
    fields = {"hidden_size": 64, "num_hidden_layers": 2, "_name_or_path": str(directory),
              "transformers_version": "4.0", **config}
    (directory / "config.json").write_text(json.dumps(fields))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return str(directory)


def test_runs_differing_only_in_seed_algorithm_and_model_path_share_an_engine(tmp_path):
    first = engine_key(load(["seed=0"]), model_dir(tmp_path, "seed0"), [0], 0.0)
    second = engine_key(load(["seed=3", "algo.mode=naive", "learner.lr=1e-3", "train.fixed_staleness=4"]),
                        model_dir(tmp_path, "seed3"), [0], 0.0)
    assert first == second


@pytest.mark.parametrize("overrides, config, cores", [
    (["rollout.dtype=bfloat16"], {}, [0]),
    (["rollout.kv_cache_gib=0.5"], {}, [0]),
    (["model.max_positions=64"], {}, [0]),
    (["rollout.num_cpus_per_generator=2"], {}, [0]),
    (["rollout.max_running_seqs=64"], {}, [0]),  # vLLM's max_num_seqs
    (["rollout.inflight_updates=true"], {}, [0]),  # prefix caching, off with in-flight loads
    ([], {"num_hidden_layers": 3}, [0]),
    ([], {}, [1]),
])
def test_a_different_architecture_engine_setting_or_core_needs_a_new_engine(tmp_path, overrides, config, cores):
    base = engine_key(load([]), model_dir(tmp_path, "a"), [0], 0.0)
    assert engine_key(load(overrides), model_dir(tmp_path, "b", **config), cores, 0.0) != base


def test_each_generator_index_has_its_own_name_in_the_pool():
    assert actor_name("study-1", 0) != actor_name("study-1", 1)
    assert actor_name("a", 0) != actor_name("b", 0)


def test_an_engine_pool_without_a_cluster_that_outlives_the_run_is_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        load(["rollout.engine_pool=p"])
    assert "rollout.engine_pool" in str(err.value) and "ray.address" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["a.b", "a b", "a/b"])
def test_an_engine_pool_name_outside_letters_digits_dash_underscore_is_refused(name):
    with pytest.raises(ConfigError, match="rollout.engine_pool"):
        load(["ray.address=127.0.0.1:6379", f"rollout.engine_pool='{name}'"])


def test_an_engine_pool_with_the_nccl_weight_group_is_refused():
    with pytest.raises(ConfigError, match="nccl"):
        load([*POOLED, "weights.backend=nccl", "device=cuda"])


def test_a_studys_runs_on_its_own_cluster_keep_unix_sockets_and_shared_memory_weights():
    cfg = load(cluster_overrides("127.0.0.1:6379", "study"))
    assert cfg.rollout.engine_pool == "study" and cfg.ray.address == "127.0.0.1:6379"
    assert wire_transport(cfg) == "ipc" and weights_backend(cfg) == "shm"


def test_a_runs_own_wire_transport_wins_over_the_clusters():
    cfg = load([*cluster_overrides("127.0.0.1:6379", "study"), "wire.transport=tcp"])
    assert wire_transport(cfg) == "tcp"


def test_a_stopped_study_cluster_is_reported_before_a_run_would_fail_to_join_it():
    import subprocess

    from asyncgrpo.study.cluster import EngineCluster

    cluster = EngineCluster(num_cpus=2, pool="p")
    cluster.address = "127.0.0.1:1"
    cluster._helper = subprocess.Popen(["sh", "-c", "exit 3"])
    cluster._helper.wait()
    with pytest.raises(RuntimeError, match=r"127\.0\.0\.1:1 has stopped .*code 3"):
        cluster.check_alive()
