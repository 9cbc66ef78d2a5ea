"""Rule-based verifiers: exact, numeric, answer extraction, math equivalence, format."""


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.rewards import verifiers as v

# The verifiers take reward.terms[].tolerance without a default; these tests use config's.
TOLERANCE = 1e-6


@pytest.mark.parametrize(("completion", "answer", "expected"), [
    ("85", "85", 1.0), (" 85\n", "85", 1.0), ("85<eos>", "85", 1.0), ("85<|im_end|>", "85", 1.0),
    ("085", "85", 0.0), ("85 86", "85", 0.0), ("", "85", 0.0),
])
def test_exact_match(completion, answer, expected):
    assert v.exact_match(completion, answer) == expected


@pytest.mark.parametrize(("completion", "answer", "tolerance", "expected"), [
    ("#### 3.0000001", "3", 1e-6, 1.0),
    ("#### 3.1", "3", 1e-6, 0.0),
    ("#### 3.1", "3", 0.05, 1.0),
    ("It costs $1,200.", "1200", 1e-6, 1.0),
    ("\\boxed{3/4}", "0.75", 1e-6, 1.0),
    ("about 50%", "50", 1e-6, 1.0),
    ("no number", "3", 1e-6, 0.0),
    ("#### 3", "three", 1e-6, 0.0),
])
def test_numeric_match_with_tolerance(completion, answer, tolerance, expected):
    assert v.numeric_match(completion, answer, tolerance=tolerance) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("work\n#### 42", "42"),
    ("so \\boxed{\\frac{1}{2}} is it", "\\frac{1}{2}"),
    ("\\boxed{a_{1}+{b}}", "a_{1}+{b}"),
    ("<answer> 3 + 4 </answer>", "3 + 4"),
    ("The answer is 12.", "12"),
    ("Final answer: x = 5", "x = 5"),
    ("first 3 then 4, finally 5", "5"),
    ("nothing here", None),
])
def test_extract_answer(text, expected):
    assert v.extract_answer(text) == expected


@pytest.mark.parametrize(("candidate", "reference", "equal"), [
    ("0.5", "\\frac{1}{2}", True),
    ("\\dfrac{1}{2}", "1/2", True),
    ("2\\sqrt{2}", "\\sqrt{8}", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("2\\pi", "\\pi \\cdot 2", True),
    ("10^{-3}", "0.001", True),
    ("1,000", "1000", True),
    ("\\$5", "5", True),
    ("45^\\circ", "45", True),
    ("\\text{7}", "7", True),
    ("3", "4", False),
    ("x+1", "x+2", False),
    ("\\sqrt{2}", "1.41", False),
    ("", "0", False),
])
def test_math_equivalence(candidate, reference, equal):
    assert v.math_equivalent(candidate, reference, tolerance=TOLERANCE) is equal


@pytest.mark.parametrize("hostile", [
    "9**9**9", "9^(9^9)", "2^(2^(2^(2^2)))", "10^100000", "__import__('os').system('true')",
    "lambda: 1", "exec(1)", "(" * 500 + "1" + ")" * 500, "x" * 10000,
])
@pytest.mark.timeout(120)  # a guard: evaluating 9**9**9 would never end
def test_hostile_answers_are_refused_not_evaluated(hostile):
    assert v.math_equivalent(hostile, "1", tolerance=TOLERANCE) is False


@settings(max_examples=50, deadline=None)
@given(numerator=st.integers(-1000, 1000), denominator=st.integers(1, 1000))
def test_a_fraction_equals_its_decimal(numerator, denominator):
    decimal = f"{numerator / denominator:.12f}"
    assert v.math_equivalent(f"\\frac{{{numerator}}}{{{denominator}}}", decimal, tolerance=TOLERANCE)
    assert v.math_reward(f"#### {numerator}/{denominator}", decimal, tolerance=TOLERANCE) == 1.0


def test_format_reward():
    assert v.format_reward("work <answer>1</answer>", r"<answer>.*?</answer>") == 1.0
    assert v.format_reward("work <answer>1", r"<answer>.*?</answer>") == 0.0
    assert v.format_reward("line\n#### 3", r"^#### \d+$") == 1.0
