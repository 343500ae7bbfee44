"""A random volundr-mixed checkpoint directory of a preset, as the real loader reads it.

    python perf/random_checkpoint.py volundr-32b [OUT_DIR] [--shard-gib 4]

Weights: bench_decode.random_quantized_state_dict (uniform random codes, scales that give
N(0, 1/in)-sized weights; host tables and other bf16 tensors from presets.init_tensor), drawn on
the GPU when there is one (seconds for Volundr-32B) and kept on the host. Files: safetensors
shards of at most --shard-gib each + model.safetensors.index.json, config.json with the
quantization_config, and the tiny checkpoints' tokenizer (converter/tokenizer.py; its ids are
below every preset's vocabulary) padded to the model's vocabulary, so that every id the random
model draws decodes to text as a real tokenizer's would (unpadded, ~98% of Volundr-32B's ids
decode to nothing and the OpenAI proxy, which skips empty deltas, would stream almost no chunks).
The directory is written under a temporary name and renamed when complete; an existing complete
one of the same preset is reused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from volundr.config import VolundrConfig
from volundr.converter.presets import get_config
from volundr.converter.tiny import GENERATION_DEFAULTS, tokenizer_config
from volundr.converter.tokenizer import load_tokenizer, special_ids, tokenizer_json

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import mixed_config, random_quantized_state_dict  # noqa: E402

MARKER = "random_checkpoint.json"  # written last: its presence means the directory is complete
FORMAT = 1  # bump when the files written here change, so that older directories are rewritten


def default_dir(preset: str) -> Path:
    return Path("/tmp") / f"volundr-{preset}-random"


def random_mixed_config(preset: str) -> VolundrConfig:
    """The preset with the tokenizer's special ids and its volundr-mixed quantization."""
    ids = special_ids(load_tokenizer())
    cfg = get_config(preset, eos_token_id=(ids["<|im_end|>"], ids["<|endoftext|>"]),
                     pad_token_id=ids["<|endoftext|>"])
    return mixed_config(cfg)


def padded_tokenizer_json(vocab_size: int) -> str:
    """The shipped tokenizer.json with BPE vocabulary entries " x<id>" for every id from its
    size up to `vocab_size`. No merge produces them and the pre-tokenizer splits letters from
    digits, so encoding is unchanged; they only give the model's other ids a text."""
    data = json.loads(tokenizer_json())
    vocab = data["model"]["vocab"]
    n = max(max(vocab.values()), *(t["id"] for t in data["added_tokens"])) + 1
    for i in range(n, vocab_size):
        vocab[f"\u0120x{i}"] = i  # (\u0120: the byte-level alphabet's space)
    return json.dumps(data, ensure_ascii=False)


def shard_plan(sizes: dict[str, int], shard_bytes: int) -> list[list[str]]:
    """Tensor names in shards of at most shard_bytes (a larger tensor gets a shard alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def is_complete(out: Path, preset: str) -> bool:
    try:
        m = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return m.get("preset") == preset and m.get("format") == FORMAT


def write_random_checkpoint(preset: str, out_dir: str | Path | None = None,
                            shard_gib: float = 4.0, device: str | None = None,
                            progress: bool = True) -> Path:
    out = Path(out_dir) if out_dir else default_dir(preset)
    if is_complete(out, preset):
        print(f"random checkpoint: reusing {out}", flush=True)
        return out
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = random_mixed_config(preset)
    for stale in out.parent.glob(f"{out.name}.partial-*"):  # (a write that was killed)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    print(f"random checkpoint: drawing {preset} (volundr-mixed) on {device}", flush=True)
    # keep_on="cpu": each tensor leaves the GPU as soon as it is drawn (the server needs it)
    sd = random_quantized_state_dict(cfg, device, keep_on="cpu")
    sd = {n: t.cpu().contiguous() for n, t in sd.items()}
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    drawn_s = time.perf_counter() - t0
    sizes = {n: t.numel() * t.element_size() for n, t in sd.items()}
    plan = shard_plan(sizes, int(shard_gib * 2**30))
    files = [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    weight_map = {}
    with tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, desc="write shards",
              disable=not progress, file=sys.stderr) as bar:
        for names, fname in zip(plan, files):
            # pop: each shard's tensors are freed once written (the host holds one copy at most)
            save_file({n: sd.pop(n) for n in names}, str(tmp / fname),
                      metadata={"format": "pt", "quantization": "volundr-mixed"})
            (tmp / fname).chmod(0o644)  # safetensors creates it owner-only
            weight_map.update(dict.fromkeys(names, fname))
            bar.update(sum(sizes[n] for n in names))
    _dump(tmp / "model.safetensors.index.json",
          {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map})
    _dump(tmp / "config.json", cfg.to_dict())
    (tmp / "tokenizer.json").write_text(padded_tokenizer_json(cfg.vocab_size), encoding="utf-8")
    _dump(tmp / "tokenizer_config.json", tokenizer_config(cfg.max_position_embeddings))
    _dump(tmp / "generation_config.json", {"bos_token_id": None,
                                           "eos_token_id": list(cfg.eos_token_id),
                                           "pad_token_id": cfg.pad_token_id,
                                           **GENERATION_DEFAULTS})
    _dump(tmp / MARKER, {"preset": preset, "format": FORMAT, "bytes": sum(sizes.values()),
                         "shards": len(files), "draw_s": round(drawn_s, 1),
                         "write_s": round(time.perf_counter() - t0 - drawn_s, 1)})
    shutil.rmtree(out, ignore_errors=True)  # (an incomplete or other preset's directory)
    tmp.rename(out)
    return out


def _dump(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("preset", help="e.g. volundr-32b, or tiny for a CPU run")
    ap.add_argument("out_dir", nargs="?", help="default /tmp/volundr-PRESET-random")
    ap.add_argument("--shard-gib", type=float, default=4.0)
    ap.add_argument("--device", help="where the weights are drawn (default: cuda if present)")
    args = ap.parse_args()
    out = write_random_checkpoint(args.preset, args.out_dir, args.shard_gib, args.device)
    print(f"random checkpoint: {out}", flush=True)


if __name__ == "__main__":
    main()
