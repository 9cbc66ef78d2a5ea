"""Parsing an LLM judge's reply into a score, and filling its prompt template."""

import pytest

from asyncgrpo.rewards.judge import JudgeParseError, fill_template, parse_score


@pytest.mark.parametrize(("reply", "parser", "score"), [
    ("7", "number", 0.7),
    ("Score: 8", "number", 0.8),
    ("I'd give it 6/10.", "number", 0.6),
    ("9 out of 10, minor issues in step 2", "number", 0.9),
    ("Step 3 is wrong. Final score: 2", "number", 0.2),
    ("10", "number", 1.0),
    ("0.5", "number", 0.05),
    ("Yes, correct.", "yes_no", 1.0),
    ("no", "yes_no", 0.0),
    ("The response is correct: yes", "yes_no", 1.0),
    ("<score>4</score>", "regex:<score>(\\d+)</score>", 0.4),
])
def test_replies_parse_to_scores(reply, parser, score):
    assert parse_score(reply, parser=parser, max_score=10) == pytest.approx(score)


@pytest.mark.parametrize(("reply", "parser"), [
    ("I cannot judge this.", "number"),
    ("Score: 85", "number"),  # outside [0, max_score]
    ("", "number"),
    ("maybe", "yes_no"),
    ("hard to say: yes or no", "yes_no"),
    ("score 4", "regex:<score>(\\d+)</score>"),
])
def test_unparseable_replies_raise(reply, parser):
    with pytest.raises(JudgeParseError):
        parse_score(reply, parser=parser, max_score=10)



def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="reward.judge.parser"):
        parse_score("7", parser="numbr", max_score=10)


def test_template_fills_fields_and_leaves_other_braces_alone():
    template = 'Q: {prompt}\nA: {completion}\nRef: {answer}\nReply as JSON {"score": n}'
    filled = fill_template(template, prompt="2+2?", completion="4", answer=None)
    assert filled == 'Q: 2+2?\nA: 4\nRef: \nReply as JSON {"score": n}'
