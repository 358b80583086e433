"""Final-answer extraction and normalisation for GSM8K and MATH.

GSM8K: the number after "The answer is" (the exemplars' form), else the last number in the text.
MATH: the last \\boxed{...} (braces balanced), else a "final answer is X" / "answer is X" form, else the
last number; then LaTeX noise is stripped so that equivalent forms compare equal (1,000 = 1000 = 1000.0,
\\frac{1}{2} = \\dfrac12 = 0.5, $5$ = 5 = 5^\\circ = \\text{5 cm}).
"""
from __future__ import annotations

import re
from fractions import Fraction

NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\.\d+")
ANSWER_IS = re.compile(r"answer is[:\s]*\$?\s*(-?[\d,]*\.?\d+)", re.IGNORECASE)
FINAL_FORMS = re.compile(r"(?:final answer|the answer)\s*(?:is|:)\s*:?\s*(.+?)(?:\.\s|\.?$|\n)", re.IGNORECASE)


def clean_number(s: str) -> str | None:
    """'$1,000.00' -> '1000'; '3.50' -> '3.5'; None when s is not a number."""
    s = s.strip().replace("$", "").replace(",", "").rstrip(".")
    try:
        value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return str(value.numerator) if value.denominator == 1 else str(float(value))


def gsm8k_answer(text: str) -> str | None:
    """The model's final number in a GSM8K chain of thought, or None."""
    m = ANSWER_IS.search(text)
    if m and (n := clean_number(m.group(1))) is not None:
        return n
    numbers = NUMBER.findall(text)
    return clean_number(numbers[-1]) if numbers else None


def gsm8k_reference(answer: str) -> str:
    """GSM8K's reference answers end with '#### N'."""
    return clean_number(answer.split("####")[-1]) or answer.split("####")[-1].strip()


def last_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...} or \\fbox{...}, with nested braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:  # `\boxed 5`
        m = re.match(r"\\boxed\s+(\S+)", text[start:])
        return m.group(1) if m else None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def math_answer(text: str) -> str | None:
    """The model's final answer to a MATH problem (not yet normalised), or None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    forms = FINAL_FORMS.findall(text)
    if forms:
        return forms[-1].strip()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _unwrap(s: str, command: str) -> str:
    """\\text{abc} -> abc for one command, nested braces kept."""
    while (i := s.find(command + "{")) >= 0:
        depth, j = 0, i + len(command)
        for j in range(i + len(command), len(s)):
            depth += {"{": 1, "}": -1}.get(s[j], 0)
            if depth == 0:
                break
        s = s[:i] + s[i + len(command) + 1 : j] + s[j + 1 :]
    return s


def normalize_math(s: str) -> str:
    """A canonical string for a MATH answer: numbers as reduced fractions or decimals, LaTeX noise removed."""
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\(?:left|right|displaystyle|!|,|;|:|quad)", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\%", "").replace("%", "")
    s = re.sub(r"\^\s*\{?\\circ\}?", "", s).replace("°", "")
    for cmd in ("\\text", "\\textbf", "\\mathrm", "\\mbox", "\\boxed"):
        s = _unwrap(s, cmd)
    # Units and a leading "x =" say nothing about the value.
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)
    s = re.sub(r"\s*(?:cm|m|km|units?|degrees?|dollars?|cents?|inches|feet|meters|square)\b.*$", "", s)
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)  # \frac12
    s = s.replace(" ", "").rstrip(".")
    frac = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    if frac and int(frac.group(3)) != 0:
        s = f"{frac.group(1)}{frac.group(2)}/{frac.group(3)}"
    number = clean_number(s) if re.fullmatch(r"-?[\d,]*\.?\d+(?:/-?\d+)?", s) else None
    return number if number is not None else s


def math_equal(predicted: str | None, reference: str) -> bool:
    if predicted is None:
        return False
    a, b = normalize_math(predicted), normalize_math(reference)
    if a == b:
        return True
    try:
        return abs(float(Fraction(a)) - float(Fraction(b))) < 1e-9
    except (ValueError, ZeroDivisionError):
        return False
