"""Recipes: a stored weight format plus a drafter (a draft mode, or prompt lookup) and a verify mode, all reading
one copy."""
from __future__ import annotations

from dataclasses import dataclass, replace

from selfspec.errors import SelfspecError
from selfspec.quant.formats import storage_supports
from selfspec.quant.modes import get_mode
from selfspec.speculative.drafters import SelfDraft, draft_modes, make_drafter

# Cheapest first: when the user names modes, the first storage that runs both is used.
STORAGE_PREFERENCE = ("int4", "int8", "planes", "dense")


@dataclass(frozen=True)
class Recipe:
    name: str
    storage: str
    verify: str
    draft: str | None  # a draft mode, 'ngram[:MIN-MAX]' (prompt lookup) or a tree drafter; None: autoregressive
    rotate: bool = False  # store weights Hadamard-rotated and rotate activations (quant/rotation.py)
    layer_skip: bool = False  # the draft skips the layers its calibration chose (speculative/layer_skip.py)
    skip_layers: tuple[int, ...] = ()  # the layers the draft skips
    draft_model: str | None = None  # recipe draft-model: the model that drafts (in mode `draft`), not these weights
    smooth_alpha: float | None = None  # SmoothQuant the weights with this migration strength (quant/smooth.py)
    kv: str = "bf16"  # KV cache format (quant/kv.py): bf16, int8, or hier (a draft mode reads its upper plane)
    kv_group: int = 128  # tokens per KV quantization group (G); the most recent G to 2G stay full precision
    draft_vocab: int = 0  # the self-draft's head reads this many most frequent tokens (speculative/draft_vocab.py)

    @property
    def speculative(self) -> bool:
        return self.draft is not None


PRESETS = {
    "ar": Recipe("ar", "dense", "fp32", None),
    "qspec": Recipe("qspec", "int4", "w4a16", "w4a4", rotate=True),  # QSpec's W4A4 needs the rotation
    "planes": Recipe("planes", "planes", "full", "upper"),
    "ngram": Recipe("ngram", "planes", "full", "ngram"),  # drafts looked up in the prompt and output, no model step
    "layerskip": Recipe("layerskip", "planes", "full", "upper", layer_skip=True),
    # A separate model drafts (its mode: --draft, by default the verify mode); the stored weights follow verify.
    "draft-model": Recipe("draft-model", "planes", "full", None),
    # Quasar: SmoothQuant W8A8 (per-channel INT8 weights, per-token INT8 activations) verifying lookup drafts.
    "quasar": Recipe("quasar", "int8", "w8a8", "ngram", smooth_alpha=0.5),
    # n-gram branches when the lookup matches, plus the upper self-draft chain; upper's tree when nothing matches.
    "hybrid": Recipe("hybrid", "planes", "full", "hybrid"),
    # A tree of 15 tokens from the verify passes' own rankings and the lookup, no model step (recycling.py): the
    # fastest at batch 1 on the H100 (docs/speculative.md).
    "recycle": Recipe("recycle", "planes", "full", "recycle-tree"),
    # Self-speculation over the KV cache too: the draft reads the upper planes of the weights and of a
    # hierarchical KV cache, verify both planes of each.
    # QuantSpec: dense verify weights with a second, INT4 copy for the draft, over a hierarchical KV cache.
    "quantspec": Recipe("quantspec", "dense+int4", "bf16", "w4a16", kv="hier"),
    "selfspec": Recipe("selfspec", "planes", "full", "upper", kv="hier"),
}


def resolve_recipe(name: str | None = None, draft: str | None = None, verify: str | None = None,
                   draft_model: str | None = None) -> Recipe:
    """A preset, optionally with its modes overridden; the storage is re-chosen if a mode needs it.
    Recipe draft-model takes the drafting model's name or path (`draft_model`); `draft` is then its mode."""
    name = name or ("draft-model" if draft_model else "ar" if draft is None and verify is not None else "planes")
    if name not in PRESETS:
        raise SelfspecError(f"unknown recipe '{name}'; choose one of: {', '.join(PRESETS)}")
    base = PRESETS[name]
    if name == "ar" and draft is not None:
        raise SelfspecError("recipe 'ar' does not draft; drop --draft or pick a speculative recipe")
    verify = verify or base.verify
    if name == "draft-model" or draft_model is not None:
        return draft_model_recipe(base, draft, verify, draft_model)
    draft = draft or base.draft
    if draft is not None:
        drafter = make_drafter(draft)  # a clear error for an unknown mode or a malformed ngram range
        if base.layer_skip and not isinstance(drafter, SelfDraft):
            raise SelfspecError(f"recipe '{name}' skips layers of one draft mode's chain; '{draft}' is not "
                                "one (a lookup draft runs no layers): drop --draft, or use --recipe ngram or hybrid")
    modes = [get_mode(m) for m in [verify] + (draft_modes(draft) if draft is not None else [])]
    if all(storage_supports(base.storage, m) for m in modes):
        return replace(base, verify=verify, draft=draft)
    for storage in STORAGE_PREFERENCE:
        if all(storage_supports(storage, m) for m in modes):
            return replace(base, storage=storage, verify=verify, draft=draft)
    pair = f"draft '{draft}' and verify '{verify}'" if draft else f"mode '{verify}'"
    raise SelfspecError(
        f"no stored weight format runs {pair} from one copy of the weights: INT4 runs w4a16/w4a8/w4a4, "
        f"INT8 runs w8a16/w8a8, INT8 planes run every w4*/w8* mode plus upper/full, dense runs fp32/bf16"
    )


def draft_model_recipe(base: Recipe, draft: str | None, verify: str, draft_model: str | None) -> Recipe:
    """Recipe draft-model: the target stores what its verify mode runs; the draft model runs `draft` (default:
    the verify mode) from its own storage, chosen alike."""
    if base.name != "draft-model":
        raise SelfspecError(f"a draft model drafts under --recipe draft-model, not '{base.name}'")
    if draft_model is None:
        raise SelfspecError("recipe 'draft-model' needs the model that drafts: --draft-model NAME_OR_PATH (a model "
                            "with the same tokenizer, e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)")
    draft = draft or verify
    if not isinstance(make_drafter(draft), SelfDraft):
        raise SelfspecError(f"under recipe 'draft-model', --draft is the draft model's mode, not '{draft}'; "
                            "for lookup drafts use --recipe ngram or hybrid, for trees --draft hybrid-tree")
    get_mode(draft)
    storage = resolve_recipe("ar", None, verify).storage
    return replace(base, storage=storage, verify=verify, draft=draft, draft_model=draft_model)
