"""GSM8K-format math word problems from a local file: the final answer follows `####` (or is in \\boxed{}).

Records hold the question and a worked answer ending in `#### <number>`, as in GSM8K; MATH-style
answers with a final \\boxed{...} also work, as does a bare final answer. The task's own check
extracts the completion's final answer (`####`, \\boxed{}, "the answer is", else the last number)
and compares it with the reference by value (numbers, fractions, sympy for expressions).
"""

from __future__ import annotations

import re

from asyncgrpo.rewards import verifiers
from asyncgrpo.tasks.files import FileTask
from asyncgrpo.tasks.problem import Problem

ANSWER_FORMAT = r"####\s*\S|\\boxed\{"
# The task's own check (held-out accuracy, and the reward when no reward.terms are set): numbers
# within this of the reference count as equal. A reward term of kind math has its own,
# reward.terms[].tolerance.
SCORE_TOLERANCE = 1e-6
_BARE_ANSWER = re.compile(r"[-+$]?[\d.,/]+%?|[-\w^{}\\()/.+* ]{1,40}")


def gsm8k_reference_answer(raw: str) -> str | None:
    """The final answer of a GSM8K/MATH-style answer field, normalized; None if it has none."""
    found = verifiers.after_hashes(raw) or verifiers.boxed_contents(raw)
    if found is None:
        stripped = raw.strip()
        # A bare final answer ("72", "3/4") is fine; a worked solution without a marked answer is not.
        if "\n" in stripped or not _BARE_ANSWER.fullmatch(stripped):
            return None
        found = stripped
    normalized = verifiers.normalize_answer(found)
    return normalized or None


class GSM8KTask(FileTask):
    name = "gsm8k"
    answer_format = ANSWER_FORMAT
    # The check may call sympy: keep it off the generator's thread.
    score_is_slow = True

    def parse_answer(self, raw: str) -> str | None:
        return gsm8k_reference_answer(raw)

    def score(self, completion_text: str, problem: Problem) -> float:
        return verifiers.math_reward(completion_text, problem.answer, tolerance=SCORE_TOLERANCE)
