"""The offline CLI on a tiny checkpoint built by the converter: a batch of prompts gives each
prompt the same greedy ids as running it alone, as one JSON object per prompt."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _generate(model_dir, *prompts, extra=()):
    cmd = [sys.executable, "-m", "volundr.generate", "--model", str(model_dir),
           "--max-tokens", "16", "--json", *extra]
    for p in prompts:
        cmd += ["--prompt", p]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    subprocess.run([sys.executable, "-m", "volundr.converter", "tiny", str(d)], check=True,
                   capture_output=True, timeout=300)
    return d


def test_batch_equals_alone_as_json(tiny_dir):
    both = _generate(tiny_dir, "hi", "a longer prompt")
    assert [r["prompt"] for r in both] == ["hi", "a longer prompt"]
    for r in both:
        assert set(r) == {"prompt", "token_ids", "text"}
        assert 0 < len(r["token_ids"]) <= 16
        [alone] = _generate(tiny_dir, r["prompt"])
        assert alone["token_ids"] == r["token_ids"]
        assert alone["text"] == r["text"]


def test_seeded_cli_sampling_is_reproducible(tiny_dir):
    a = _generate(tiny_dir, "hello there", extra=["--temperature", "0.8", "--seed", "7"])
    b = _generate(tiny_dir, "hello there", extra=["--temperature", "0.8", "--seed", "7"])
    assert a == b


def test_bad_model_dir_is_one_clear_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "volundr.generate", "--model",
                          str(tmp_path / "nope"), "--prompt", "x"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr and "nope" in out.stderr
