import pytest

from asyncgrpo.runtime.resources import CPU_ATTENTION_HEAD_SIZES, cpu_head_size_error, parse_cores, plan_cores


def test_parse_cores():
    assert parse_cores("0,2-4, 7") == [0, 2, 3, 4, 7]
    assert parse_cores("") == []


def test_auto_gives_each_process_its_own_core():
    generators, learners = plan_cores(1, 1, "auto", "auto", available=[0, 1])
    assert generators == [[0]] and learners == [[1]]


def test_auto_pins_nothing_when_cores_are_short():
    generators, learners = plan_cores(2, 1, "auto", "auto", available=[0, 1])
    assert generators == [[], []] and learners == [[]]


def test_explicit_spec():
    generators, learners = plan_cores(2, 1, "0|1", "2-3", available=[0, 1, 2, 3])
    assert generators == [[0], [1]] and learners == [[2, 3]]
    with pytest.raises(ValueError):
        plan_cores(2, 1, "0", "1", available=[0, 1])


def test_the_cpu_head_sizes_are_the_installed_vllm_cpu_attention_backends():
    backend = pytest.importorskip("vllm.v1.attention.backends.cpu_attn").CPUAttentionBackend
    assert list(CPU_ATTENTION_HEAD_SIZES) == backend.get_supported_head_sizes()


def test_a_head_size_vllm_cpu_attention_cannot_run_is_named_with_the_sizes_it_can():
    assert cpu_head_size_error(64) is None
    assert cpu_head_size_error(16) == (
        "head_dim 16: vLLM's CPU attention runs only head_dim 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512")
