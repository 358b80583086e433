"""Evaluation tasks. A generation task module defines NAME, STOP, load_items(path, chat) and score(item, text);
`ppl` is the one scoring task (it reads logits instead of generating)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType

from selfspec.errors import SelfspecError


@dataclass
class Item:
    id: str
    prompt: str | list[dict]  # plain text, or chat messages (the few-shot turns + the question)
    reference: str  # the gold answer (GSM8K, MATH) or the test code (HumanEval)
    data: dict = field(default_factory=dict)  # task-specific extras (HumanEval's entry point)


TASK_NAMES = ("gsm8k", "humaneval", "math500", "ppl")


def get_task(name: str) -> ModuleType:
    """The task's module, imported on demand (the task modules import Item from this one)."""
    if name not in TASK_NAMES:
        raise SelfspecError(f"unknown task '{name}'; choose from: {', '.join(TASK_NAMES)}")
    return importlib.import_module(f"selfspec.eval.tasks.{name}")
