"""Evaluation tasks. A generation task module defines NAME, STOP, load_items(path, chat) and score(item, text);
`ppl` is the one scoring task (it reads logits instead of generating)."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

from selfspec.errors import SelfspecError


@dataclass
class Item:
    id: str
    prompt: str | list[dict]  # plain text, or chat messages (the few-shot turns + the question)
    reference: str  # the gold answer (GSM8K, MATH) or the test code (HumanEval)
    data: dict = field(default_factory=dict)  # task-specific extras (HumanEval's entry point)


def get_task(name: str) -> ModuleType:
    from selfspec.eval.tasks import gsm8k, humaneval, math500, ppl

    tasks = {m.NAME: m for m in (gsm8k, humaneval, math500, ppl)}
    if name not in tasks:
        raise SelfspecError(f"unknown task '{name}'; choose from: {', '.join(tasks)}")
    return tasks[name]


TASK_NAMES = ("gsm8k", "humaneval", "math500", "ppl")
