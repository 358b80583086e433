"""engine/detokenize.py through LLM.append_tokens: the incremental text against decoding the whole output each
round (what append_tokens did before), on SmolLM2's byte-level tokenizer, over random round sizes."""
import random

import pytest

from selfspec.engine.llm import LLM, Generation
from selfspec.loading.named import DEFAULT_MODEL, named_model_path
from selfspec.loading.tokenizer import load_tokenizer
from selfspec.speculative.sampling import SamplingParams

TEXTS = [
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5",
    "Le café est naïve? Où ça! 你好，世界。 Emoji 🙂🚀 then ASCII again.",
    "Numbers 1,234.56 and   spaces\t\ttabs\n\n\nnewlines — dashes … ellipses «quotes»",
]


@pytest.fixture(scope="module")
def llm():
    """An LLM with SmolLM2's tokenizer and nothing else: append_tokens reads only the tokenizer and the EOS ids."""
    llm = object.__new__(LLM)
    llm.tokenizer = load_tokenizer(named_model_path(DEFAULT_MODEL))
    llm.eos_ids = {llm.tokenizer.eos_token_id}
    return llm


def whole_decode_append(llm, out: Generation, chunk: list[int], params: SamplingParams) -> tuple[list[int], bool]:
    """append_tokens as it was: the whole output decoded every round. -> (tokens kept, finished)"""
    chunk = chunk[: params.max_new_tokens - len(out.token_ids)]
    eos_at = next((i for i, t in enumerate(chunk) if t in llm.eos_ids), None)
    if eos_at is not None:
        chunk, out.finish_reason = chunk[:eos_at], "stop"
    start = len(out.token_ids)
    out.token_ids.extend(chunk)
    text = llm._decode(out.token_ids)
    if any(s in text for s in params.stop):
        end = next(k for k in range(start + 1, len(out.token_ids) + 1)
                   if any(s in llm._decode(out.token_ids[:k]) for s in params.stop))
        del out.token_ids[end:]
        chunk, text = chunk[: end - start], llm._decode(out.token_ids)
        text, out.finish_reason = text[:min(i for i in (text.find(s) for s in params.stop) if i >= 0)], "stop"
    out.text = text
    return chunk, out.finish_reason == "stop" or len(out.token_ids) >= params.max_new_tokens


def incremental(llm, params: SamplingParams):
    """LLM.append_tokens as run_rounds takes an append: (out, chunk) -> (tokens kept, new text, finished)."""
    def append(out: Generation, chunk: list[int]) -> tuple[list[int], str, bool]:
        new, kept, finished = llm.append_tokens(out, chunk, params)
        return kept, new, finished
    return append


def run_rounds(append, ids: list[int], rng: random.Random) -> tuple[Generation, list[int], list[str]]:
    """Feed ids in rounds of 1-9 tokens (a round's accepted drafts and its next token) until finished."""
    out, kept, deltas, i = Generation("", [], "length"), [], [], 0
    while i < len(ids):
        n = rng.randint(1, 9)
        chunk_kept, new, finished = append(out, ids[i:i + n])
        kept += chunk_kept
        deltas.append(new)
        i += n
        if finished:
            break
    return out, kept, deltas


@pytest.mark.parametrize("seed", range(6))
def test_incremental_text_is_the_whole_decode(llm, seed):
    """Random round sizes over texts whose characters span several tokens (emoji, CJK): the streamed pieces join
    into the whole decode, each piece free of half characters; the kept tokens, finish reason and final text are
    those of decoding the whole output every round. Stop strings from the text itself, EOS and max_new_tokens."""
    rng = random.Random(seed)
    text = TEXTS[seed % len(TEXTS)]
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    cases = [SamplingParams(max_new_tokens=len(ids) + 5), SamplingParams(max_new_tokens=rng.randint(3, len(ids)))]
    at = rng.randint(5, len(text) - 8)
    cases.append(SamplingParams(max_new_tokens=len(ids) + 5, stop=[text[at:at + rng.randint(1, 4)], "zzz-never"]))
    eos = ids[:rng.randint(4, len(ids) - 2)] + [llm.tokenizer.eos_token_id] + ids[-2:]
    for params, stream in [(p, ids) for p in cases] + [(cases[0], eos)]:
        def whole(out, chunk):
            kept, finished = whole_decode_append(llm, out, chunk, params)
            return kept, "", finished

        got, kept, deltas = run_rounds(incremental(llm, params), stream, random.Random(seed))
        want, want_kept, _ = run_rounds(whole, stream, random.Random(seed))
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
        assert kept == want_kept == got.token_ids
        assert "".join(deltas) == got.text
        assert not any(d.endswith("\ufffd") for d in deltas)


def test_random_tokens_end_as_the_whole_decode(llm):
    """Tokens that need not make text (byte pieces out of order): the final text is still the whole decode."""
    rng = random.Random(7)
    vocab = len(llm.tokenizer)
    for _ in range(5):
        ids = [rng.randrange(vocab) for _ in range(60)]
        params = SamplingParams(max_new_tokens=60, ignore_eos=True)
        out, kept, deltas = run_rounds(incremental(llm, params), ids, rng)
        assert out.text == llm._decode(ids) and kept == ids


def test_a_stop_string_across_rounds_of_one_token(llm):
    """A stop string begun in text emitted rounds before: found where it completes, the text cut before it."""
    ids = llm.tokenizer.encode(TEXTS[0], add_special_tokens=False)
    params = SamplingParams(max_new_tokens=len(ids), stop=["return a + b"])
    out, kept = Generation("", [], "length"), []
    for t in ids:
        new, chunk_kept, finished = llm.append_tokens(out, [t], params)
        kept += chunk_kept
        if finished:
            break
    assert (out.text, out.finish_reason) == ("def add(a, b):\n    ", "stop")
    assert kept == out.token_ids and llm._decode(kept).endswith("return a + b")
