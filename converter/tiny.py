"""Write a complete, deterministic Hugging Face style checkpoint directory of a tiny preset.

    python -m volundr.converter tiny OUT_DIR [--seed N] [--preset tiny|draft-tiny]

Files: config.json, model.safetensors (bf16 random weights, see presets.init_tensor),
tokenizer.json (the shipped byte-level BPE), tokenizer_config.json (with the chat template of
data/chat_template.jinja), generation_config.json. The same seed gives byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from volundr.converter.presets import get_config, random_state_dict
from volundr.converter.tokenizer import (
    DATA_DIR,
    SPECIAL_TOKENS,
    load_tokenizer,
    special_ids,
    tokenizer_json,
)

CHAT_TEMPLATE_PATH = DATA_DIR / "chat_template.jinja"

# Sampling defaults a client gets when it sets nothing (Qwen3-like: mild temperature, nucleus).
GENERATION_DEFAULTS = {"do_sample": True, "temperature": 0.7, "top_p": 0.95}


def chat_template() -> str:
    return CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")


def _dump(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def tokenizer_config(model_max_length: int) -> dict:
    tok = load_tokenizer()
    decoder = {str(tok.token_to_id(s)): {"content": s, "lstrip": False, "normalized": False,
                                         "rstrip": False, "single_word": False, "special": True}
               for s in SPECIAL_TOKENS}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": decoder,
        "chat_template": chat_template(),
    }


def build_tiny(out_dir: str | Path, seed: int = 0, preset: str = "tiny") -> Path:
    """Write the checkpoint of `preset` (tiny | draft-tiny) with weights from `seed`."""
    if preset not in ("tiny", "draft-tiny"):
        raise ValueError(f"tiny builds presets tiny and draft-tiny, not {preset!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # A stale sharded checkpoint in OUT_DIR would shadow model.safetensors in the loader.
    for stale in [out / "model.safetensors.index.json", *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    tok = load_tokenizer()
    ids = special_ids(tok)
    eos = (ids["<|im_end|>"], ids["<|endoftext|>"])
    cfg = get_config(preset, vocab_size=tok.get_vocab_size(), eos_token_id=eos,
                     pad_token_id=ids["<|endoftext|>"], seed=seed)

    _dump(out / "config.json", cfg.to_dict())
    tensors = random_state_dict(cfg, "cpu", seed=seed)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors creates it owner-only
    (out / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    _dump(out / "tokenizer_config.json", tokenizer_config(cfg.max_position_embeddings))
    _dump(out / "generation_config.json", {
        "bos_token_id": None,
        "eos_token_id": list(eos),
        "pad_token_id": cfg.pad_token_id,
        **GENERATION_DEFAULTS,
    })
    return out
