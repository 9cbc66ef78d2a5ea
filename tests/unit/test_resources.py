import pytest

from asyncgrpo.runtime.resources import parse_cores, plan_cores


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
