"""The Python API: load a model once under a recipe, then generate (whole or streamed)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import torch

from selfspec.config import ModelConfig
from selfspec.engine.detokenize import TextWindow, advance, finish, pending_text
from selfspec.engine.graphs import GraphedModel
from selfspec.engine.stats import GenerationStats
from selfspec.errors import SelfspecError
from selfspec.model import Transformer
from selfspec.parallel import SOLO, TensorParallel, shard_state_dict
from selfspec.quant.kv import check_kv_format
from selfspec.quant.modes import get_mode
from selfspec.quant.smooth import activation_maxima, calibration_tokens, smooth_
from selfspec.speculative.decode import decode
from selfspec.speculative.draft_model import DraftModel, check_same_vocabulary
from selfspec.speculative.draft_vocab import DraftVocabulary, frequent_tokens, reference_texts
from selfspec.speculative.drafters import HybridDrafter, RecycleTree, SelfDraft, gamma_policy, make_drafter
from selfspec.speculative.recipes import Recipe, resolve_recipe
from selfspec.speculative.recycling import text_successors
from selfspec.speculative.sampling import SamplingParams

MAX_GAMMA = 32


@dataclass
class Generation:
    text: str
    token_ids: list[int]  # up to EOS (left out) or the token that completes a stop string (the text ends before it)
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: GenerationStats = field(default_factory=GenerationStats)
    window: TextWindow = field(default_factory=TextWindow, repr=False)  # the incremental decode's (detokenize.py)


def seed_successors(tokenizer, width: int) -> dict[int, tuple[int, ...]]:
    """A recycled tree's table to start from: each token's most frequent next tokens in the reference texts (the
    draft vocabulary's, speculative/draft_vocab.py), before any verify pass has ranked it; none where the data
    packages are not installed (the table then starts from the prompt's text alone)."""
    try:
        texts, _ = reference_texts()
    except SelfspecError:
        return {}
    return text_successors([tokenizer.encode(t, add_special_tokens=False) for t in texts], width)


class LLM:
    def __init__(self, model: Transformer, tokenizer, recipe: Recipe, gamma: int = 4, description: str = "",
                 fixed_gamma: bool = False, drafter: DraftModel | None = None):
        """`drafter`: recipe draft-model's drafting model (load() builds it from recipe.draft_model)."""
        if (recipe.draft_model is not None) != (drafter is not None):
            raise SelfspecError("recipe 'draft-model' and a DraftModel go together: load the draft model with "
                                "selfspec.load(..., recipe='draft-model', draft_model=NAME_OR_PATH)")
        self.model = model
        model.set_kv_format(recipe.kv, recipe.kv_group)
        # On the GPU, decode steps replay CUDA graphs (the host would otherwise set the speed); a quantized KV
        # cache settles its buffer between passes, eagerly, outside the graphs.
        graphed = model.device.type == "cuda"
        self.runner = GraphedModel(model) if graphed else model
        self.tokenizer = tokenizer
        self.recipe = recipe
        self.gamma = gamma
        self.description = description
        self.verify_mode = get_mode(recipe.verify)
        self.drafter = drafter or (make_drafter(recipe.draft) if recipe.draft else None)
        if drafter is not None:
            self.description += f"; {drafter.describe()}"
        # The draft steps of a chain in a draft mode (None: no draft steps, or another model's)
        self.draft_mode = self.drafter.mode if isinstance(self.drafter, (SelfDraft, HybridDrafter)) else None
        self.draft_vocab: DraftVocabulary | None = None  # recipe.draft_vocab: the tokens the draft's head reads
        self.eos_ids = set(model.cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        if isinstance(self.drafter, RecycleTree) and tokenizer is not None:
            self.drafter = replace(self.drafter, base=seed_successors(tokenizer, self.drafter.width))
            self.description += f"; recycled tree seeded with {len(self.drafter.base)} tokens' successors in text"
        if recipe.draft_vocab and self.draft_mode is None:
            raise SelfspecError(f"--draft-vocab shrinks the head of a draft mode's steps; recipe '{recipe.name}' "
                                f"drafts with '{recipe.draft}', which runs none: drop --draft-vocab")
        if self.draft_mode is not None:
            if recipe.draft_vocab:  # the draft's head reads the most frequent tokens' rows only
                self.draft_vocab = frequent_tokens(tokenizer, model.lm_head.weight.shape[0], recipe.draft_vocab,
                                                   self.eos_ids)
                model.set_draft_vocab(self.draft_vocab.ids())
                self.draft_mode = replace(self.draft_mode, draft_vocab=True)
                head = model.draft_head.weight
                self.description += (f"; draft head: {recipe.draft_vocab} tokens counted on "
                                     f"{', '.join(self.draft_vocab.sources)} "
                                     f"(+{head.numel() * head.element_size() / 2**20:.1f} MiB)")
            if recipe.skip_layers:  # layer-skip: the draft mode skips them
                self.draft_mode = replace(self.draft_mode, skip_layers=frozenset(recipe.skip_layers))
            if recipe.kv == "hier":  # the draft reads the KV's upper plane
                self.draft_mode = replace(self.draft_mode, kv_upper=True)
            self.drafter = replace(self.drafter, mode=self.draft_mode)
        # gamma caps the drafts per round; the policy (shared by this LLM's generations, which teach it the
        # step costs and the acceptance) picks each round's, drafting none where drafting loses.
        # fixed_gamma: draft gamma tokens every round.
        self.fixed_gamma = fixed_gamma
        self.policy = gamma_policy(self.drafter, gamma)

    def fit_draft_vocab(self, prompt: list[int]) -> None:
        """With a draft vocabulary, its tokens for this prompt's decoding: the prompt's own join the counted ones
        (solo decoding: the engine's batch keeps the counted ones alone)."""
        if self.draft_vocab is not None:
            self.model.set_draft_vocab(self.draft_vocab.ids(prompt))

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, self.model.cfg.max_seq_len, prompt, chat)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, chat: bool = False,
               gamma: int | None = None) -> Iterator[tuple[str, list[int], Generation]]:
        """Yield (new text, new token ids, running Generation) as tokens are accepted. `gamma`: draft that many
        tokens every round (0: autoregressive); None: the LLM's gamma, as a cap for its policy unless fixed."""
        params = params or SamplingParams()
        policy = self.policy if gamma is None and not self.fixed_gamma else None
        gamma = self.gamma if gamma is None else gamma
        check_gamma(gamma)
        ids = self.encode(prompt, chat)
        self.check_context(len(ids), params.max_new_tokens)
        out = Generation("", [], "length", GenerationStats(prompt_tokens=len(ids)))
        t0 = time.perf_counter()
        draft = self.drafter if gamma > 0 else None
        if draft is not None:
            self.fit_draft_vocab(ids)
        for chunk in decode(self.runner, ids, self.verify_mode, draft, gamma, params, out.stats, policy=policy):
            new_text, chunk, finished = self.append_tokens(out, chunk, params)
            out.stats.total_s = time.perf_counter() - t0
            yield new_text, chunk, out
            if finished:
                break

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None, chat: bool = False,
                 gamma: int | None = None) -> Generation:
        out = None
        for _, _, out in self.stream(prompt, params, chat, gamma):
            pass
        return out

    def close(self) -> None:
        """Release the decode passes' CUDA graphs (a tensor-parallel LLM also ends its worker processes)."""
        if isinstance(self.runner, GraphedModel):
            self.runner.release()

    def check_context(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Refuse, with the numbers, a request that would run past the context window (the server does too)."""
        context = self.model.cfg.max_seq_len
        if prompt_tokens + max_new_tokens > context:
            why = " (its sliding window)" if context == self.model.cfg.sliding_window else ""
            raise SelfspecError(
                f"the model's context window is {context} tokens{why}, but the prompt ({prompt_tokens} tokens) plus "
                f"max-new-tokens ({max_new_tokens}) asks for {prompt_tokens + max_new_tokens}; shorten the prompt "
                f"or ask for at most {context - prompt_tokens} new tokens"
            )

    def append_tokens(self, out: Generation, chunk: list[int], params: SamplingParams) -> tuple[str, list[int], bool]:
        """Add a round's committed tokens to `out`, cut at max_new_tokens, EOS and stop strings.
        Returns (new text, the tokens kept, finished); the serving engine uses it too."""
        chunk = chunk[: params.max_new_tokens - len(out.token_ids)]
        if not params.ignore_eos:
            eos_at = next((i for i, t in enumerate(chunk) if t in self.eos_ids), None)
            if eos_at is not None:
                chunk, out.finish_reason = chunk[:eos_at], "stop"
        new_text, chunk = self._extend(out, chunk, params)
        out.stats.new_tokens = len(out.token_ids)
        return new_text, chunk, out.finish_reason == "stop" or len(out.token_ids) >= params.max_new_tokens

    def _extend(self, out: Generation, chunk: list[int], params: SamplingParams) -> tuple[str, list[int]]:
        """Append tokens; return the new text, cut before the first stop string, and the tokens kept: those up to
        the one that completes the stop string (the ones after it were never part of the output). The new text is
        decoded from a window of the last tokens (engine/detokenize.py), the whole output's once it finishes."""
        start = len(out.token_ids)
        out.token_ids.extend(chunk)
        if self.tokenizer is None:
            return "", chunk
        pending, complete = pending_text(self._decode, out.token_ids, out.window)
        reach = max(map(len, params.stop), default=1) - 1  # a stop string may begin in the text emitted before
        if any(s in out.text[max(0, len(out.text) - reach):] + pending for s in params.stop):
            end = next(k for k in range(start + 1, len(out.token_ids) + 1)
                       if any(s in self._decode(out.token_ids[:k]) for s in params.stop))
            del out.token_ids[end:]
            chunk, text = chunk[: end - start], self._decode(out.token_ids)
            cut = min(i for i in (text.find(s) for s in params.stop) if i >= 0)
            text, out.finish_reason = text[:cut], "stop"
            new, out.text = text[len(out.text):], text
            return new, chunk
        if out.finish_reason == "stop" or len(out.token_ids) >= params.max_new_tokens:  # EOS or length
            out.text, new = finish(self._decode, out.token_ids, out.text)
            return new, chunk
        if not complete:
            return "", chunk
        advance(out.window, len(out.token_ids))
        out.text += pending
        return pending, chunk

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def encode_prompt(tokenizer, max_seq_len: int, prompt: str | list[int], chat: bool = False) -> list[int]:
    """Token ids of `prompt` (text, or ids as they are), checked to fit a context of `max_seq_len`."""
    if isinstance(prompt, list):
        ids = prompt
    else:
        check_prompt(prompt)
        if tokenizer is None:
            raise SelfspecError("this model has no tokenizer files; pass token ids instead of text")
        if chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = tokenizer.encode(prompt)
    if not ids:
        raise SelfspecError("the prompt is empty after tokenization")
    if len(ids) >= max_seq_len:
        raise SelfspecError(f"the prompt has {len(ids)} tokens; the model's context window is {max_seq_len}")
    return ids


def check_prompt(prompt: str) -> None:
    """A non-empty prompt of valid Unicode: undecodable input bytes (which Python keeps as lone surrogates) are
    refused rather than replaced, since the model would otherwise see other text than the user wrote."""
    if not prompt.strip():
        raise SelfspecError("the prompt is empty; give some text with --prompt or on stdin")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(prompt[e.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        raise SelfspecError(f"the prompt is not valid UTF-8 ({what} at character {e.start}); convert it to UTF-8 "
                            "first, e.g. with iconv -f latin1 -t utf-8") from None


def check_gamma(gamma: int) -> None:
    if not 0 <= gamma <= MAX_GAMMA:
        raise SelfspecError(f"gamma must be between 0 and {MAX_GAMMA} drafted tokens per round, got {gamma}")


def check_group_size(group_size: int) -> None:
    if group_size < 1:
        raise SelfspecError(f"group size must be >= 1 (weights per quantization group along K), got {group_size}")


def check_device(device: str) -> None:
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise SelfspecError(f"unknown device '{device}'; use cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        raise SelfspecError(f"device '{device}' asked for, but no CUDA device is available to torch")


def cpu_threads() -> int | None:
    """Torch threads for decoding on the CPU: SELFSPEC_THREADS if set; torch's own default if OMP_NUM_THREADS is
    set; else 1. A decode step is a chain of small products: on a CPU shared with other jobs, OpenMP threads
    spin-waiting for a descheduled peer made SmolLM2 decoding 3-12x slower at 2 threads than at 1, and at best
    (an idle machine) 2 threads were no faster. On a dedicated machine with a larger model, set it."""
    value = os.environ.get("SELFSPEC_THREADS")
    if value is None:
        return None if "OMP_NUM_THREADS" in os.environ else 1
    if not value.isdigit() or int(value) < 1:
        raise SelfspecError(f"SELFSPEC_THREADS must be a whole number >= 1 (torch threads), got '{value}'")
    return int(value)


def build_model(cfg, state_dict, storage: str, group_size: int = 128, rotate: bool = False,
                device: str = "cpu", smooth: float | None = None, tokenizer=None,
                tp: TensorParallel = SOLO) -> Transformer:
    """The model in its stored format; with `smooth`, SmoothQuant-ed first (migration strength alpha, activation
    maxima calibrated through `tokenizer`'s text: quant/smooth.py). Under tensor parallelism (`tp`), this rank's
    shard of it, sharded before quantizing (parallel/shard.py)."""
    state_dict = shard_state_dict(state_dict, tp.rank, tp.size)
    if torch.device(device).type == "cuda":  # the GPU kernels run bf16 activations (quant scales stay fp32)
        state_dict = {name: t.bfloat16() if t.is_floating_point() else t for name, t in state_dict.items()}
    model = Transformer(cfg, state_dict, tp)
    state_dict.clear()  # the float weights are now owned by the model (or freed once quantized)
    if smooth is not None:  # calibrated where it will run: that device's kernels and precision
        model.to(device)
        smooth_(model, activation_maxima(model, calibration_tokens(tokenizer)), smooth)
    model.quantize(storage, group_size, rotate)
    return model.to(device)


def build(cfg, state_dict, tokenizer, recipe: Recipe, group_size: int = 128, gamma: int = 4,
          device: str = "cpu", description: str = "", fixed_gamma: bool = False,
          drafter: DraftModel | None = None, tp: TensorParallel = SOLO) -> LLM:
    model = build_model(cfg, state_dict, recipe.storage, group_size, recipe.rotate, device, recipe.smooth_alpha,
                        tokenizer, tp)
    return LLM(model, tokenizer, recipe, gamma, description, fixed_gamma, drafter)


def build_draft_model(cfg, tokenizer, name: str, draft: tuple, recipe: Recipe, group_size: int = 128,
                      device: str = "cpu") -> DraftModel:
    """The drafting model of recipe draft-model (recipe.draft_model) from its resolved (config, weights, tokenizer,
    description), stored as its mode needs; refused unless it shares the tokens of the model `name`."""
    draft_cfg, draft_sd, draft_tok, _ = draft
    check_same_vocabulary(name, cfg, tokenizer, recipe.draft_model, draft_cfg, draft_tok)
    storage = resolve_recipe("ar", None, recipe.draft).storage
    model = build_model(draft_cfg, draft_sd, storage, group_size, device=device)
    return DraftModel(model, get_mode(recipe.draft), recipe.draft_model)


def load(model: str | None = None, recipe: str | None = None, draft: str | None = None, verify: str | None = None,
         gamma: int = 4, group_size: int = 128, device: str = "cpu", fixed_gamma: bool = False,
         draft_model: str | None = None, kv: str | None = None, kv_group: int | None = None,
         tensor_parallel: int = 1, draft_vocab: int | None = None) -> LLM:
    """Load a named model, HF directory or .gguf file under a recipe (default: `planes`). `gamma` caps the drafted
    tokens per round, each round's picked by a measured-cost policy; with `fixed_gamma`, every round drafts gamma.
    Recipe draft-model drafts with `draft_model` (a name or path, same tokenizer), in mode `draft`. `kv`, `kv_group`:
    the KV cache format and its group, in place of the recipe's (quant/kv.py). `draft_vocab` N: a self-draft's head
    reads the N most frequent tokens only (speculative/draft_vocab.py; 0: all). `tensor_parallel` N > 1: the model
    split across N processes (one GPU each on CUDA), this one rank 0 (parallel/launch.py); close() ends them."""
    args = dict(model=model, recipe=recipe, draft=draft, verify=verify, gamma=gamma, group_size=group_size,
                device=device, fixed_gamma=fixed_gamma, draft_model=draft_model, kv=kv, kv_group=kv_group,
                draft_vocab=draft_vocab)
    if tensor_parallel == 1:
        return load_rank(**args)
    from selfspec.parallel.launch import start

    return start(tensor_parallel, args)


def load_rank(model: str | None = None, recipe: str | None = None, draft: str | None = None,
              verify: str | None = None, gamma: int = 4, group_size: int = 128, device: str = "cpu",
              fixed_gamma: bool = False, draft_model: str | None = None, kv: str | None = None,
              kv_group: int | None = None, draft_vocab: int | None = None,
              join: Callable[[ModelConfig, Recipe], TensorParallel] | None = None) -> LLM:
    """`load` in one process: the whole model, or with `join` one tensor-parallel rank's shard. `join(cfg, recipe)`
    runs once both are known, before anything is built: it refuses what tensor parallelism cannot split, then joins
    the group (parallel/launch.py)."""
    from selfspec.loading import DEFAULT_MODEL, resolve
    from selfspec.speculative.layer_skip import calibrated_recipe

    check_gamma(gamma)
    check_group_size(group_size)
    check_device(device)
    threads = cpu_threads() if torch.device(device).type == "cpu" else None
    if threads is not None:
        torch.set_num_threads(threads)
    rec = resolve_recipe(recipe, draft, verify, draft_model)
    rec = replace(rec, kv=kv or rec.kv, kv_group=rec.kv_group if kv_group is None else kv_group,
                  draft_vocab=rec.draft_vocab if draft_vocab is None else draft_vocab)
    check_kv_format(rec.kv, rec.kv_group)
    cfg, sd, tok, desc = resolve(model)
    if rec.layer_skip:
        rec = calibrated_recipe(rec, model, group_size, device, cfg.n_layers)
    drafter = None
    if rec.draft_model is not None:
        drafter = build_draft_model(cfg, tok, model or DEFAULT_MODEL, resolve(rec.draft_model), rec, group_size,
                                    device)
        # The draft model drafts only inside its own context window.
        cfg = replace(cfg, max_seq_len=min(cfg.max_seq_len, drafter.model.cfg.max_seq_len))
    tp = SOLO if join is None else join(cfg, rec)
    return build(cfg, sd, tok, rec, group_size, gamma, device, desc, fixed_gamma, drafter, tp)
