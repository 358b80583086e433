"""The CLI turns bad input into one clean line, `selfspec: error: ...`, a non-zero exit and no traceback;
argument errors are reported before any model is loaded."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import selfspec
import selfspec.loading
from conftest import tiny_model
from selfspec.cli import main
from selfspec.engine.llm import Generation
from selfspec.errors import SelfspecError
from selfspec.speculative.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))


def save_byte_tokenizer(path: Path) -> None:
    """A 256-token byte-level tokenizer (no merges): text in, ids 0..255 out, matching the tiny vocab."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=alphabet[2]).save_pretrained(path)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """(HF directory with a tokenizer, HF directory without one), both of a tiny random Llama."""
    _, _, hf = tiny_model("llama", seed=0)
    with_tok, no_tok = tmp_path_factory.mktemp("tiny"), tmp_path_factory.mktemp("tiny-notok")
    hf.save_pretrained(with_tok)
    hf.save_pretrained(no_tok)
    save_byte_tokenizer(with_tok)
    return with_tok, no_tok


def run(capsys, *args: str) -> tuple[int, str, str]:
    try:
        rc = main(["generate", *args])
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_clean_error(rc: int, err: str, *needles: str) -> None:
    assert rc not in (0, None), err
    assert err.startswith("selfspec: error: "), err
    assert "Traceback" not in err
    assert err.count("\n") == 1, err  # one line
    for n in needles:
        assert n in err, (n, err)


def test_valid_run_succeeds(capsys, tiny_dirs):
    """The baseline the error cases differ from: the tiny model generates."""
    rc, out, err = run(capsys, "--model", str(tiny_dirs[0]), "--prompt", "hello", "--max-new-tokens", "6",
                       "--group-size", "32")
    assert rc == 0, err
    assert "recipe planes" in err and "Traceback" not in err
    rc, out, err = run(capsys, "--model", str(tiny_dirs[0]), "--prompt", "hello", "--max-new-tokens", "5",
                       "--json", "--temperature", "0.8", "--top-p", "0.9", "--seed", "1", "--recipe", "qspec")
    assert rc == 0, err
    res = json.loads(out)
    assert res["recipe"] == "qspec" and res["storage"] == "int4" and res["stats"]["prompt_tokens"] == 5



def test_ngram_recipe_generates(capsys, tiny_dirs):
    rc, out, err = run(capsys, "--model", str(tiny_dirs[0]), "--prompt", "hello hello hello hello", "--json",
                       "--max-new-tokens", "12", "--recipe", "ngram", "--draft", "ngram:1-2", "--fixed-gamma")
    assert rc == 0, err
    res = json.loads(out)
    assert (res["recipe"], res["storage"], res["draft"], res["verify"]) == ("ngram", "planes", "ngram:1-2", "full")
    assert res["stats"]["new_tokens"] == 12


def test_kv_format_and_group_override_the_recipe(capsys, tiny_dirs):
    rc, out, err = run(capsys, "--model", str(tiny_dirs[0]), "--prompt", "hello " * 12, "--json", "--group-size", "32",
                       "--max-new-tokens", "20", "--recipe", "selfspec", "--kv", "int8", "--kv-group", "8")
    assert rc == 0, err
    res = json.loads(out)
    assert (res["recipe"], res["kv"]) == ("selfspec", "int8") and res["stats"]["new_tokens"] == 20
    rc, _, err = run(capsys, "--model", str(tiny_dirs[0]), "--prompt", "hi", "--kv", "hier", "--kv-group", "0")
    assert_clean_error(rc, err, "KV quantization group", "got 0")


# Errors in the arguments: reported before any model is loaded (loading would fail the test).
BEFORE_LOADING = {
    "unknown verify mode": (["--verify", "w9a9"], "unknown mode 'w9a9'", "w4a16"),
    "unknown draft mode": (["--draft", "int3"], "unknown mode 'int3'"),
    "gamma -1": (["--gamma", "-1"], "gamma must be between 0 and 32", "got -1"),
    "gamma 1000": (["--gamma", "1000"], "gamma must be between 0 and 32", "got 1000"),
    "temperature -1": (["--temperature", "-1"], "temperature must be 0 (greedy) or a finite number >= 1e-06"),
    "temperature 1e-45": (["--temperature", "1e-45"], "temperature must be 0 (greedy)", "got 1e-45"),
    "temperature nan": (["--temperature", "nan"], "temperature must be 0 (greedy)", "got nan"),
    "top-p 0": (["--top-p", "0"], "top-p must be between 1e-06 and 1"),
    "top-p 1e-100": (["--top-p", "1e-100"], "top-p must be between 1e-06 and 1"),
    "top-p 1.5": (["--top-p", "1.5"], "top-p must be between 1e-06 and 1"),
    "seed 2**70": (["--seed", str(1 << 70)], "seed must be a signed 64-bit integer"),
    "top-k -1": (["--top-k", "-1"], "top-k must be >= 0"),
    "max-new-tokens 0": (["--max-new-tokens", "0"], "max-new-tokens must be >= 1"),
    "empty prompt": (["--prompt", ""], "the prompt is empty"),
    "blank prompt": (["--prompt", "  \n\t "], "the prompt is empty"),
    "draft/verify pair": (["--draft", "w4a16", "--verify", "bf16"], "no stored weight format runs",
                          "'w4a16'", "'bf16'"),
    "ar with a draft": (["--recipe", "ar", "--draft", "w4a4"], "recipe 'ar' does not draft"),
    "ngram range reversed": (["--recipe", "ngram", "--draft", "ngram:3-1"], "1 <= min_n <= max_n", "ngram:1-3"),
    "ngram range malformed": (["--draft", "ngram:2"], "unknown drafter 'ngram:2'", "ngram:MIN-MAX"),
    "qspec verify bf16": (["--recipe", "qspec", "--verify", "bf16"], "no stored weight format runs"),
    "group size 0": (["--group-size", "0"], "group size must be >= 1"),
    "group size -8": (["--group-size", "-8"], "group size must be >= 1"),
    "unknown device": (["--device", "tpu9"], "device 'tpu9'"),
    # $'caf\xe9 \xff' in argv: Python keeps the undecodable bytes as lone surrogates
    "non-UTF-8 prompt": (["--prompt", "caf\udce9 \udcff"], "the prompt is not valid UTF-8", "byte 0xe9", "iconv"),
}


@pytest.mark.parametrize("case", list(BEFORE_LOADING))
def test_argument_errors_before_loading(capsys, monkeypatch, case):
    args, *needles = BEFORE_LOADING[case]
    calls = []

    def no_loading(*a, **k):
        calls.append(a)
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(selfspec.loading, "resolve", no_loading)
    if "--prompt" not in args:
        args = [*args, "--prompt", "hello"]
    rc, out, err = run(capsys, *args)
    assert not calls
    assert_clean_error(rc, err, *needles)
    assert out == ""


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])  # surrogateescape: stdin in the C locale
def test_non_utf8_stdin(capsys, monkeypatch, errors):
    monkeypatch.setattr(selfspec.loading, "resolve", lambda *a: pytest.fail("loaded"))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 \xff"), encoding="utf-8", errors=errors))
    rc, out, err = run(capsys)
    assert_clean_error(rc, err, "not valid UTF-8", "0xe9", "iconv")


def test_non_utf8_prompt_through_the_api(tiny_dirs):
    llm = selfspec.load(str(tiny_dirs[0]), "ar")
    with pytest.raises(SelfspecError, match="lone surrogate U\\+D800"):
        llm.generate("caf\ud800", SamplingParams(max_new_tokens=2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(capsys, monkeypatch):
    monkeypatch.setattr(selfspec.loading, "resolve", lambda *a: pytest.fail("loaded"))
    rc, _, err = run(capsys, "--device", "cuda", "--prompt", "hi")
    assert_clean_error(rc, err, "cuda", "no CUDA device")


@pytest.mark.parametrize("args,needle", [(["--recipe", "nope"], "invalid choice: 'nope'"),
                                         (["--gamma", "two"], "invalid int value: 'two'")])
def test_argparse_rejects(capsys, args, needle):
    rc, out, err = run(capsys, *args, "--prompt", "hi")
    assert rc == 2
    assert needle in err and "Traceback" not in err
    if "--recipe" in args:
        assert "ar" in err and "qspec" in err and "planes" in err  # the choices are listed


# Errors in the model: found while loading, still one clean line.


def test_missing_model_path(capsys, tmp_path):
    rc, _, err = run(capsys, "--model", str(tmp_path / "nowhere"), "--prompt", "hi")
    assert_clean_error(rc, err, "does not exist", "nowhere")


def test_unsupported_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2,
                                                      "vocab_size": 256}))
    rc, _, err = run(capsys, "--model", str(tmp_path), "--prompt", "hi")
    assert_clean_error(rc, err, "unsupported architecture 'gpt2'", "llama, mistral, qwen2, qwen3")


def test_directory_without_config(capsys, tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    rc, _, err = run(capsys, "--model", str(tmp_path), "--prompt", "hi")
    assert_clean_error(rc, err, "config.json")


def test_corrupt_config_json(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    rc, _, err = run(capsys, "--model", str(tmp_path), "--prompt", "hi")
    assert_clean_error(rc, err, "config.json")


@pytest.mark.parametrize("content", [
    b"this is not a gguf file at all" * 10,  # wrong magic
    b"GGUF\x03\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00\x09\x00",  # right magic, truncated header
    b"",  # empty
], ids=["garbage", "truncated", "empty"])
def test_corrupt_gguf(capsys, tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    rc, _, err = run(capsys, "--model", str(path), "--prompt", "hi")
    assert_clean_error(rc, err, "model.gguf")


def test_corrupt_safetensors(capsys, tmp_path, tiny_dirs):
    (tmp_path / "config.json").write_text((tiny_dirs[1] / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    rc, _, err = run(capsys, "--model", str(tmp_path), "--prompt", "hi")
    assert_clean_error(rc, err, "model.safetensors")


def test_text_prompt_without_tokenizer(capsys, tiny_dirs):
    rc, _, err = run(capsys, "--model", str(tiny_dirs[1]), "--prompt", "hi")
    assert_clean_error(rc, err, "no tokenizer")


def test_subprocess_exit_code_and_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "SELFSPEC_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "selfspec.cli", "generate", "--model", str(tmp_path / "missing"),
                           "--prompt", "hi"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("selfspec: error: ") and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


# Nothing cut short or miscounted without a word.


def test_prompt_plus_new_tokens_past_the_context_is_refused(capsys, tiny_dirs):
    """Like the server's context_length_exceeded: an error with the numbers, not an early finish_reason 'length'."""
    rc, out, err = run(capsys, "--model", str(tiny_dirs[0]), "--prompt", "hello", "--max-new-tokens", "600")
    assert_clean_error(rc, err, "context window is 512 tokens", "prompt (5 tokens)", "max-new-tokens (600)",
                       "at most 507 new tokens")
    assert out == ""
    rc, out, err = run(capsys, "--model", str(tiny_dirs[0]), "--prompt", "hello", "--max-new-tokens", "507",
                       "--json", "--recipe", "ar")
    assert rc == 0, err  # exactly filling the context is fine


@pytest.mark.parametrize("chunks", [["abc STOP def"], ["abc S", "TOP def", "gh"]], ids=["one round", "across rounds"])
def test_token_ids_end_with_the_stop_string(tiny_dirs, chunks):
    """token_ids and stats.new_tokens stop at the token that completes the stop string, as the text does."""
    llm = selfspec.load(str(tiny_dirs[0]), "ar")
    enc = llm.tokenizer.encode
    params = SamplingParams(max_new_tokens=50, stop=["STOP"])
    out, kept = Generation("", [], "length"), []
    for chunk in chunks:
        text, chunk_kept, finished = llm.append_tokens(out, enc(chunk), params)
        kept += chunk_kept
        if finished:
            break
    assert (out.text, out.finish_reason) == ("abc ", "stop")
    assert out.token_ids == kept == enc("abc STOP")
    assert out.stats.new_tokens == len(out.token_ids)


def test_ar_banner_names_no_draft_or_gamma(capsys, tiny_dirs):
    rc, out, err = run(capsys, "--model", str(tiny_dirs[0]), "--prompt", "hello", "--max-new-tokens", "3",
                       "--recipe", "ar")
    assert rc == 0, err
    banner = err.splitlines()[-1]
    assert "recipe ar" in banner and "autoregressive" in banner
    assert "draft" not in banner.split("]")[0] and "gamma" not in banner
    rc, out, err = run(capsys, "--model", str(tiny_dirs[0]), "--prompt", "hello", "--max-new-tokens", "3",
                       "--recipe", "ar", "--json")
    res = json.loads(out)
    assert (res["draft"], res["gamma"]) == (None, 0)


# Benchmarks: their own help anywhere, a clean error where they need a GPU that is not there.

CUDA_BENCHES = ["all", "steps", "gemm", "prefill", "spec", "peer", "tune"]


@pytest.mark.parametrize("name", CUDA_BENCHES + ["trace", "lookup", "policy"])
def test_bench_help_is_the_benchmarks_own(capsys, name):
    with pytest.raises(SystemExit) as e:
        main(["bench", name, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert out.startswith(f"usage: selfspec bench {name} [-h]"), out


def test_policy_replay_of_a_missing_trace_says_where_the_traces_are(capsys):
    rc = main(["bench", "policy", "--trace", "no-such-trace.json", "--plain-ms", "4", "--tree-ms", "16:5"])
    _, err = capsys.readouterr()
    assert rc == 2 and "no-such-trace.json" in err and "selfspec/bench/traces" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("name", CUDA_BENCHES)
def test_gpu_bench_without_cuda(capsys, name):
    rc = main(["bench", name])
    _, err = capsys.readouterr()
    assert rc == 2
    assert_clean_error(rc, err, f"selfspec bench {name}` needs a CUDA GPU")
