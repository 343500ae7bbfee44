"""Tiny checkpoints, the tokenizer, presets and `inspect` (CPU, a few seconds)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from volundr.config import VolundrConfig
from volundr.converter.__main__ import main
from volundr.converter.corpus import build_corpus
from volundr.converter.loader import load_checkpoint
from volundr.converter.presets import get_config, init_tensor, random_state_dict
from volundr.converter.tiny import build_tiny
from volundr.converter.tokenizer import CORPUS_PATH, SPECIAL_TOKENS, load_tokenizer, train_tokenizer
from volundr.memory import plan_memory
from volundr.model.weights import count_parameters, expected_tensors

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json")


def _hashes(d: Path) -> dict[str, str]:
    return {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in FILES}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "a": build_tiny(root / "a", seed=0),
        "b": build_tiny(root / "b", seed=0),
        "c": build_tiny(root / "c", seed=1),
        "draft": build_tiny(root / "draft", seed=0, preset="draft-tiny"),
    }


def test_tiny_builds_and_loads(tiny_dirs):
    d = tiny_dirs["a"]
    assert all((d / f).is_file() for f in FILES)
    cfg, tensors = load_checkpoint(d)
    tok = load_tokenizer(d)
    assert cfg.vocab_size == tok.get_vocab_size() == 4096
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (64, 8, 128)
    assert cfg.attention_layers == [3, 7]
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.engram.layers == (1, 5) and len(cfg.engram.hash_seeds) == 8
    assert all(0 < s < 2**31 for s in cfg.engram.hash_seeds)
    assert cfg.mtp.num_layers == 1
    assert cfg.eos_token_id == (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    assert cfg.pad_token_id == cfg.engram.pad_id == tok.token_to_id("<|endoftext|>") == 0
    spec = expected_tensors(cfg)
    assert set(tensors) == set(spec)
    for name, t in tensors.items():
        assert tuple(t.shape) == spec[name].shape and t.dtype == torch.bfloat16, name
        assert torch.isfinite(t.float()).all(), name
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == list(cfg.eos_token_id) and gen["pad_token_id"] == 0
    tc = json.loads((d / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|im_end|>" and tc["bos_token"] is None
    assert "<|im_start|>" in tc["chat_template"]


def test_init_scales(tiny_dirs):
    _, t = load_checkpoint(tiny_dirs["a"])
    std = lambda n: t[n].float().std().item()
    assert abs(std("model.embed_tokens.weight") - 1.0) < 0.05
    assert abs(std("model.layers.0.mlp.up_proj.weight") - 64**-0.5) < 0.02
    # residual outputs scaled down by sqrt(2)
    assert abs(std("model.layers.0.mlp.down_proj.weight") - (2 * 128) ** -0.5) < 0.01
    # lm_head: N(0, 1/hidden) entries, rows scaled by a log-normal factor (sigma 0.3)
    row_rms = t["lm_head.weight"].float().pow(2).mean(1).sqrt() * 64**0.5
    assert abs(row_rms.log().std().item() - 0.3) < 0.05 and abs(row_rms.median() - 1) < 0.1
    assert (t["model.norm.weight"] == 1).all()
    a = t["model.layers.0.kda.A_log"].float().exp()
    assert ((a >= 1) & (a <= 16.1)).all()
    dt = torch.nn.functional.softplus(t["model.layers.0.kda.dt_bias"].float())
    assert ((dt > 5e-4) & (dt < 0.11)).all()


def test_deterministic_per_seed(tiny_dirs):
    a, b, c = (_hashes(tiny_dirs[k]) for k in "abc")
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert a["config.json"] != c["config.json"]  # the Engram hash seeds depend on the seed
    assert a["tokenizer.json"] == c["tokenizer.json"]  # one vocabulary for all tiny checkpoints


def test_draft_tiny(tiny_dirs):
    cfg, tensors = load_checkpoint(tiny_dirs["draft"])
    main = VolundrConfig.from_json(tiny_dirs["a"])
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (32, 4)
    assert cfg.engram.layers == () and cfg.mtp.num_layers == 0
    assert cfg.vocab_size == main.vocab_size and cfg.eos_token_id == main.eos_token_id
    assert not any(n.startswith("mtp.") or ".engram." in n for n in tensors)
    assert _hashes(tiny_dirs["draft"])["tokenizer.json"] == _hashes(tiny_dirs["a"])[
        "tokenizer.json"]


def test_tokenizer_round_trip_and_specials():
    tok = load_tokenizer()
    for text in ["Hello, world! The smith lit the forge.", "今天天气很好，我们去公园散步吧。",
                 "東京の夏 / 오늘은 날씨가 🚀🎉 👨‍👩‍👧‍👦", "def f(x):\n    return x * 2\n",
                 "  leading spaces and\ttabs\n\n", "rare bytes: \x00\x7f é ß ∑"]:
        ids = tok.encode(text).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i
        enc = tok.encode(f"a{s}b")
        assert i in enc.ids and enc.tokens.count(s) == 1
    assert tok.token_to_id("<|endoftext|>") == 0
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2
    # A common word is one token: the BPE learned real merges.
    assert len(tok.encode(" the").ids) == 1


def test_corpus_and_training_reproduce_shipped_files():
    assert CORPUS_PATH.read_text(encoding="utf-8") == build_corpus()
    text = CORPUS_PATH.read_text(encoding="utf-8")
    assert 100_000 < len(text.encode()) < 220_000
    a, b = train_tokenizer(text), train_tokenizer(text)
    assert a.to_str() == b.to_str()  # training is deterministic
    assert a.get_vocab() == load_tokenizer().get_vocab()  # the shipped file is this training


def test_presets_match_model_card():
    c = get_config("volundr-32b")
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.intermediate_size) == (
        262144, 5120, 72, 17408)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (40, 2, 128)
    assert (c.kda.num_heads, c.kda.head_dim, c.kda.conv_size, c.kda.rank) == (40, 128, 4, 128)
    assert c.engram.layers == (1, 15) and c.engram.dim == 256
    assert c.engram.rows_per_head == 524288 and c.mtp.num_layers == 1
    assert c.max_position_embeddings == 262144 and c.vision is not None
    assert len(c.attention_layers) == 18 and c.kv_bytes_per_token == 18 * 1024
    assert 27.0e9 < count_parameters(c)["compute"] < 27.8e9
    d = get_config("volundr-draft")
    assert (d.hidden_size, d.num_hidden_layers, d.intermediate_size) == (1024, 16, 3072)
    assert (d.num_attention_heads, d.num_key_value_heads, d.head_dim) == (8, 2, 128)
    assert d.engram.layers == () and d.vision is None
    # config.json round trip
    assert VolundrConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_memory_plan_volundr_32b():
    bf16 = plan_memory(get_config("volundr-32b"), 16)
    assert not bf16.fits and bf16.kv_gpu_tokens == 0 and "NO" in bf16.describe()
    q = plan_memory(get_config("volundr-32b-q"), 16)
    assert q.fits and 10e9 < q.weights_gpu_bytes < 12e9 and 3.0 < q.weight_bits < 3.4
    assert 120 << 20 < q.state_bytes_per_seq < 150 << 20  # ~140 MiB per conversation
    assert 6e9 < q.host_bytes < 7.5e9  # embedding 2.7 GB + Engram 4.3 GB
    left = 16 * 2**30 - q.weights_gpu_bytes - q.state_bytes_per_seq - q.activation_reserve_bytes
    assert q.kv_gpu_tokens == left // q.kv_bytes_per_token
    q4 = plan_memory(get_config("volundr-32b-q"), 16, max_num_seqs=4)
    assert q4.kv_gpu_tokens < q.kv_gpu_tokens
    assert q.kv_bytes_per_token == 19 * 1024  # 18 attention layers + the MTP layer
    assert bf16.state_bytes_per_seq == get_config("volundr-32b").kda_state_bytes + 2 * 3 * 5120 * 2
    tiny = plan_memory(get_config("tiny"), None, max_num_seqs=3)
    assert tiny.fits and tiny.kv_gpu_tokens == 3 * 2048


def test_random_state_dict_matches_tiny(tiny_dirs):
    cfg, tensors = load_checkpoint(tiny_dirs["a"])
    sd = random_state_dict(cfg, "cpu", seed=0, parts=("compute",))
    assert sd and all(expected_tensors(cfg)[n].part == "compute" for n in sd)
    for name, t in sd.items():
        assert torch.equal(t, tensors[name]), name
    spec = expected_tensors(cfg)["model.layers.0.kda.q_proj.weight"]
    one = init_tensor("model.layers.0.kda.q_proj.weight", spec, cfg, 0, "cpu")
    assert torch.equal(one, tensors["model.layers.0.kda.q_proj.weight"])


def _cli(*args: str) -> SimpleNamespace:
    """The command in-process (fast); test_inspect_cli runs one real subprocess too."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())


def test_inspect_cli(tiny_dirs, tmp_path):
    r = subprocess.run([sys.executable, "-m", "volundr.converter", "inspect",
                        str(tiny_dirs["a"]), "--gpu-gib", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "KDA layers (6)" in r.stdout and "engram" in r.stdout and "fits: yes" in r.stdout
    # config.json alone is enough
    (tmp_path / "config.json").write_bytes((tiny_dirs["a"] / "config.json").read_bytes())
    r = _cli("inspect", str(tmp_path), "--json", "--max-num-seqs", "2")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["parameters"]["embedding"] == 4096 * 64
    assert s["memory"]["kv_gpu_tokens"] == 2 * 2048 and s["architecture"]["attention_layers"] == [
        3, 7]
    r = _cli("inspect", "--preset", "volundr-32b", "--gpu-gib", "16")
    assert r.returncode == 0, r.stderr
    assert "attention layers (18)" in r.stdout and "fits: NO" in r.stdout
    r = _cli("inspect", "--preset", "volundr-32b-q", "--gpu-gib", "16")
    assert r.returncode == 0 and "fits: yes" in r.stdout and "3.2" in r.stdout
    bf16 = json.loads(_cli("inspect", "--preset", "volundr-32b-q", "--gpu-gib", "16",
                           "--json").stdout)["memory"]
    fp8 = json.loads(_cli("inspect", "--preset", "volundr-32b-q", "--gpu-gib", "16", "--json",
                          "--kv-cache-dtype", "fp8").stdout)["memory"]
    assert fp8["kv_dtype"] == "float8_e4m3fn" and bf16["kv_dtype"] == "bfloat16"
    assert fp8["kv_gpu_tokens"] // 2 == bf16["kv_gpu_tokens"]
    r = _cli("inspect", str(tmp_path / "nope"))
    assert r.returncode == 2 and "nope" in r.stderr
