"""Answer extraction and normalisation for GSM8K and MATH."""
from __future__ import annotations

import pytest

from selfspec.eval.extract import gsm8k_answer, gsm8k_reference, last_boxed, math_answer, math_equal, normalize_math


@pytest.mark.parametrize("text, expected", [
    (" She has 16 - 3 - 4 = 9 eggs. 9 * 2 = 18. The answer is 18.", "18"),
    ("The answer is $1,250.", "1250"),
    ("The answer is 3.50 dollars.", "3.5"),
    ("The answer is -7.", "-7"),
    ("So he paid 10 + 5 = 15 dollars in total", "15"),  # no "answer is": the last number
    ("1.5 hours is 90 minutes. The answer is 90.\n\nQ: next question with 42", "90"),
    ("No numbers here.", None),
])
def test_gsm8k_answer(text, expected):
    assert gsm8k_answer(text) == expected


def test_gsm8k_reference_takes_the_number_after_hashes():
    assert gsm8k_reference("16 - 3 - 4 = <<16-3-4=9>>9\n9 * 2 = $<<9*2=18>>18\n#### 1,018") == "1018"


@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("first \\boxed{3} then \\boxed{x^{2}+1}", "x^{2}+1"),  # the last one, nested braces kept
    ("\\fbox{7}", "7"),
    ("no box", None),
    ("unbalanced \\boxed{3", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("We get $x=4$, so \\boxed{4}.", "4"),
    ("Thus the final answer is 12.", "12"),
    ("The answer is: 2/3\n", "2/3"),
    ("adding gives 5 and then 8", "8"),
])
def test_math_answer_forms(text, expected):
    assert math_answer(text) == expected


@pytest.mark.parametrize("predicted, reference", [
    ("1,000", "1000"),
    ("1000.0", "1000"),
    ("$42$", "42"),
    ("\\dfrac{1}{2}", "0.5"),
    ("\\frac12", "1/2"),
    ("\\frac{4}{2}", "2"),
    ("90^\\circ", "90"),
    ("90^{\\circ}", "90"),
    ("\\text{5 cm}", "5"),
    ("5\\text{ cm}", "5"),
    ("x = 7", "7"),
    ("25\\%", "25"),
    ("\\left( 1, 2 \\right)", "(1,2)"),
])
def test_equivalent_forms_are_equal(predicted, reference):
    assert math_equal(predicted, reference)


@pytest.mark.parametrize("predicted, reference",
                         [("41", "42"), ("\\frac{1}{3}", "0.5"), (None, "3"), ("(1,3)", "(1,2)")])
def test_different_answers_are_not_equal(predicted, reference):
    assert not math_equal(predicted, reference)


def test_normalize_keeps_non_numeric_answers_comparable():
    assert normalize_math("\\text{(B)}") == "(B)"
    assert normalize_math("\\sqrt{2}") == "\\sqrt{2}"
