"""The checkpoint loader: clear errors for broken checkpoints, sharded and quantized layouts,
and resolving a Hugging Face repo id while offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from volundr.config import ConfigError, VolundrConfig
from volundr.converter.loader import (
    CheckpointError,
    ModelNotFoundError,
    load_checkpoint,
    resolve_model_dir,
)
from volundr.converter.tiny import build_tiny
from volundr.model.weights import expected_tensors


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("ckpt") / "tiny", seed=3)


@pytest.fixture()
def copy(tiny, tmp_path):
    """A fresh copy of the tiny checkpoint and its tensors, to break."""
    d = tmp_path / "ckpt"
    shutil.copytree(tiny, d)
    return d, load_file(str(d / "model.safetensors"))


def _save(d, tensors):
    save_file(tensors, str(d / "model.safetensors"))


def test_missing_tensor_named(copy):
    d, t = copy
    del t["model.layers.2.kda.A_log"], t["lm_head.weight"]
    _save(d, t)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d)
    msg = str(e.value)
    assert "missing (2)" in msg and "model.layers.2.kda.A_log" in msg and "lm_head.weight" in msg


def test_wrong_shape_named(copy):
    d, t = copy
    t["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(16, 64, dtype=torch.bfloat16)
    _save(d, t)
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.self_attn\.k_proj\.weight: "
                       r"expected \[32, 64\], found \[16, 64\]"):
        load_checkpoint(d)


def test_unexpected_tensor_named(copy):
    d, t = copy
    t["model.layers.0.kda.extra_bias"] = torch.zeros(4)
    _save(d, t)
    with pytest.raises(CheckpointError,
                       match=r"unexpected \(1\): model\.layers\.0\.kda\.extra_bias"):
        load_checkpoint(d)


def test_all_problems_in_one_message(copy):
    d, t = copy
    del t["model.norm.weight"]
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:100].clone()
    t["junk"] = torch.zeros(1)
    _save(d, t)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d)
    msg = str(e.value)
    assert "model.norm.weight" in msg and "junk" in msg
    assert "model.embed_tokens.weight: expected [4096, 64], found [100, 64]" in msg


def test_bad_config_json(copy):
    d, _ = copy
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"], cfg["kda"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="missing field.*hidden_size.*kda"):
        load_checkpoint(d)
    (d / "config.json").write_text('{"vocab_size": 4096,')
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_checkpoint(d)
    (d / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        load_checkpoint(d)


def test_no_weights(copy):
    d, _ = copy
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(d)


def test_sharded_checkpoint(copy, tiny):
    d, t = copy
    (d / "model.safetensors").unlink()
    names = sorted(t)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for f, ns in shards.items():
        save_file({n: t[n] for n in ns}, str(d / f), metadata={"format": "pt"})
        weight_map.update({n: f for n in ns})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))
    cfg, loaded = load_checkpoint(d)
    _, ref = load_checkpoint(tiny)
    assert set(loaded) == set(ref)
    assert all(torch.equal(loaded[n], ref[n]) for n in ref)
    # a shard named by the index but absent is reported by name
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_checkpoint(d)


def test_dtype_and_host_parts(tiny):
    cfg, t = load_checkpoint(tiny, device="cpu", dtype=torch.float32)
    assert all(x.dtype == torch.float32 for x in t.values())
    if torch.cuda.is_available():
        _, g = load_checkpoint(tiny, device="cuda")
        assert g["model.embed_tokens.weight"].device.type == "cpu"
        assert g["model.layers.1.engram.tables.0"].device.type == "cpu"
        assert g["lm_head.weight"].device.type == "cuda"


def test_quantized_names_accepted(copy):
    d, t = copy
    cfg = json.loads((d / "config.json").read_text())
    module = "model.layers.0.mlp.up_proj"
    cfg["quantization_config"] = {"method": "volundr-mixed", "group_size": 128,
                                  "bits": {module: 4}}
    (d / "config.json").write_text(json.dumps(cfg))
    w = t.pop(module + ".weight")
    t[module + ".qweight"] = torch.zeros(w.shape[0], w.shape[1] // 8, dtype=torch.int32)
    t[module + ".scales"] = torch.ones(w.shape[0], 1, dtype=torch.bfloat16)
    _save(d, t)
    with pytest.raises(CheckpointError,
                       match=r"missing \(1\): model\.layers\.0\.mlp\.up_proj\.zeros"):
        load_checkpoint(d)
    t[module + ".zeros"] = torch.zeros(w.shape[0], 1, dtype=torch.bfloat16)
    _save(d, t)
    c, loaded = load_checkpoint(d, dtype=torch.float32)
    assert loaded[module + ".qweight"].dtype == torch.int32
    assert module + ".weight" not in loaded and c.quantization.bits == {module: 4}
    assert len(loaded) == len(expected_tensors(VolundrConfig.from_json(d))) + 2


def test_resolve_local_and_missing(tiny, tmp_path):
    assert resolve_model_dir(str(tiny)) == tiny
    with pytest.raises(ModelNotFoundError, match="no checkpoint directory"):
        resolve_model_dir(str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match="is a file"):
        resolve_model_dir(str(tiny / "config.json"))


def test_resolve_repo_id_offline(tmp_path):
    # HF_HUB_OFFLINE is read when huggingface_hub is imported: use a fresh interpreter.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    code = ("from volundr.converter.loader import resolve_model_dir\n"
            "try:\n    resolve_model_dir('volundr-test/no-such-model')\n"
            "except FileNotFoundError as e:\n    print('ERR', e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ERR") and "volundr-test/no-such-model" in r.stdout
    assert "Hugging Face hub" in r.stdout and "local checkpoint directory" in r.stdout
