"""Rule-based verifiers: exact match, numeric match, final-answer extraction, math equivalence, format.

All are pure functions of text returning a float in [0, 1]. Math equivalence uses sympy only when
cheaper checks (normalized strings, numbers) cannot decide, and only on sanitized input: sympy's
parser evaluates Python, so model output reaches it only as digits, operators and a few names.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

EOS_MARKERS = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*\$?([^\n$]+?)\$?\s*(?:\.\s*)?(?:\n|$)", re.IGNORECASE)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def strip_eos(text: str) -> str:
    text = text.strip()
    stripped = True
    while stripped:
        stripped = False
        for marker in EOS_MARKERS:
            if text.endswith(marker):
                text = text[: -len(marker)].rstrip()
                stripped = True
    return text


def exact_match(completion: str, answer: str) -> float:
    """1.0 when the whole completion, stripped of whitespace and end markers, is the answer."""
    return 1.0 if strip_eos(completion) == answer.strip() else 0.0


def boxed_contents(text: str) -> str | None:
    """The contents of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        # "\boxed 5" (no braces) is valid LaTeX for one token.
        rest = text[start:].split(None, 1)
        return rest[1].split("$")[0].strip() if len(rest) > 1 else None
    depth = 0
    for index in range(brace, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1:index].strip()
    return None


def after_hashes(text: str) -> str | None:
    """GSM8K's final answer: what follows the last `####`, up to the end of that line."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    tail = tail.splitlines()[0].strip() if tail else ""
    return tail.rstrip(".").strip() or None


def extract_answer(text: str, *, fallback_last_number: bool = True) -> str | None:
    """The final answer in a completion: `####`, then \\boxed{}, <answer></answer>, "answer is", last number."""
    text = strip_eos(text)
    for found in (after_hashes(text), boxed_contents(text)):
        if found:
            return found
    tags = _ANSWER_TAG.findall(text)
    if tags and tags[-1].strip():
        return tags[-1].strip()
    stated = _ANSWER_IS.findall(text)
    if stated:
        return stated[-1].strip()
    if fallback_last_number:
        numbers = _NUMBER.findall(text)
        if numbers:
            return numbers[-1].rstrip(",")
    return None


def parse_number(text: str) -> float | None:
    """A plain number, with thousands separators, a leading $, a trailing %, or a fraction a/b."""
    text = normalize_answer(text)
    try:
        return float(Fraction(text))
    except (ValueError, ZeroDivisionError):
        pass
    match = re.fullmatch(r"(-?\d+(?:\.\d+)?)/(-?\d+(?:\.\d+)?)", text)
    if match and float(match.group(2)) != 0:
        return float(match.group(1)) / float(match.group(2))
    return None


def numeric_match(completion: str, answer: str, *, tolerance: float) -> float:
    """1.0 when the completion's final answer is a number within `tolerance` (absolute or relative) of the answer.

    `tolerance` is the term's reward.terms[].tolerance (no default here: config's is the only one).
    """
    expected = parse_number(answer)
    found = extract_answer(completion)
    value = parse_number(found) if found is not None else None
    if expected is None or value is None:
        return 0.0
    return 1.0 if math.isclose(value, expected, rel_tol=tolerance, abs_tol=tolerance) else 0.0


_LATEX_REPLACEMENTS = (
    ("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\ ", ""), ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"), ("^\\circ", ""), ("^{\\circ}", ""), ("\\%", ""), ("%", ""), ("\\$", ""), ("$", ""),
    ("\\cdot", "*"), ("\\times", "*"), ("\\div", "/"),
)


def normalize_answer(text: str) -> str:
    """Strip formatting that does not change a final answer's value."""
    text = text.strip()
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    text = re.sub(r"\\mbox\{([^{}]*)\}", r"\1", text)
    for old, new in _LATEX_REPLACEMENTS:
        text = text.replace(old, new)
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)  # 1,234 -> 1234
    text = text.replace(" ", "").rstrip(".")
    if text.startswith("x=") or text.startswith("y="):
        text = text[2:]
    return text


MAX_MATH_CHARS = 120
_SAFE_EXPRESSION = re.compile(r"[0-9a-zA-Z+\-*/^().\s]*")
_ALLOWED_NAMES = {"sqrt", "pi"}


def _latex_to_sympy_text(text: str) -> str | None:
    for _ in range(8):  # nested \frac{\frac{a}{b}}{c}: innermost first
        replaced = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", text)
        replaced = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", replaced)
        replaced = re.sub(r"\\frac(\d)(\d)", r"((\1)/(\2))", replaced)
        if replaced == text:
            break
        text = replaced
    text = text.replace("\\pi", "pi").replace("{", "(").replace("}", ")").replace("^", "**")
    if "\\" in text or not _SAFE_EXPRESSION.fullmatch(text):
        return None
    for name in re.findall(r"[a-zA-Z]+", text):
        if len(name) > 1 and name not in _ALLOWED_NAMES:
            return None
    return text


MAX_EXPONENT = 100


def _sympy_value(text: str):  # noqa: ANN202 - a sympy expression
    """Parse unevaluated, refuse powers that could explode (9**9**9), then evaluate."""
    import sympy
    from sympy.parsing.sympy_parser import (
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    transformations = standard_transformations + (implicit_multiplication_application,)
    tree = parse_expr(text, transformations=transformations, evaluate=False)
    # Innermost powers first, so evaluating an exponent only computes powers already checked.
    for node in sympy.postorder_traversal(tree):
        if isinstance(node, sympy.Pow) and node.exp.is_number:
            exponent = node.exp.doit()
            if not (exponent.is_Rational and abs(exponent.p) <= MAX_EXPONENT and abs(exponent.q) <= MAX_EXPONENT):
                raise ValueError(f"exponent {exponent} is too large to check")
    return parse_expr(text, transformations=transformations, evaluate=True)


def math_equivalent(candidate: str, reference: str, *, tolerance: float) -> bool:
    """Whether two final answers denote the same value: strings, then numbers (within `tolerance`,
    absolute or relative), then sympy."""
    left, right = normalize_answer(candidate), normalize_answer(reference)
    if not left or not right:
        return False
    if left == right:
        return True
    left_number, right_number = parse_number(left), parse_number(right)
    if left_number is not None and right_number is not None:
        return math.isclose(left_number, right_number, rel_tol=tolerance, abs_tol=tolerance)
    if max(len(left), len(right)) > MAX_MATH_CHARS:
        return False
    left_text, right_text = _latex_to_sympy_text(left), _latex_to_sympy_text(right)
    if left_text is None or right_text is None:
        return False
    try:
        import sympy

        difference = sympy.simplify(_sympy_value(left_text) - _sympy_value(right_text))
        if difference == 0:
            return True
        if difference.free_symbols:
            return False
        return abs(complex(difference.evalf())) <= tolerance
    except Exception:  # sympy raises many types on malformed input; unparseable is simply not equal
        return False


def math_reward(completion: str, answer: str, *, tolerance: float) -> float:
    """1.0 when the completion's final answer (####, \\boxed{}, "answer is", last number) equals the reference."""
    found = extract_answer(completion)
    return 1.0 if found is not None and math_equivalent(found, answer, tolerance=tolerance) else 0.0


def format_reward(completion: str, pattern: str) -> float:
    """1.0 when the completion contains a match of `pattern` (multi-line, dot matches newline)."""
    return 1.0 if re.search(pattern, completion, re.DOTALL | re.MULTILINE) else 0.0
