import pytest

from asyncgrpo.tasks import ArithmeticTask
from asyncgrpo.tasks.stream import PromptStream


def stream() -> PromptStream:
    return PromptStream(ArithmeticTask(num_digits=2, eval_size=10).train_problems(seed=3))


def test_a_resumed_stream_continues_where_the_saved_one_stood():
    first = stream()
    first.take(5)
    state = first.state_dict()
    expected = [p.id for p in first.take(4)]
    resumed = stream()
    resumed.load_state_dict(state)
    assert resumed.position == 5
    assert [p.id for p in resumed.take(4)] == expected


def test_position_counts_what_was_handed_out_and_a_finite_stream_ends():
    finite = PromptStream(iter(ArithmeticTask(num_digits=2, eval_size=10).eval_problems()[:3]))
    assert len(finite.take(2)) == 2 and finite.position == 2
    assert len(finite.take(5)) == 1 and finite.position == 3
    assert finite.take(1) == []


def test_a_stream_cannot_go_back():
    s = stream()
    s.take(3)
    with pytest.raises(ValueError, match="cannot go back"):
        s.load_state_dict({"position": 1})
