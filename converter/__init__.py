"""Volundr checkpoints: tiny random checkpoints, presets, the loader and `inspect`.

    python -m volundr.converter tiny OUT_DIR [--seed N] [--preset tiny|draft-tiny]
    python -m volundr.converter inspect DIR|--preset NAME [--gpu-gib G] [--json]

Modules: tiny (writer), presets (configs and random init), loader (resolve_model_dir,
load_checkpoint, CheckpointError), tokenizer (the shipped BPE), corpus, summary (inspect).
"""
