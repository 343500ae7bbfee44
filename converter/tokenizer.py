"""The tiny checkpoints' tokenizer: a byte-level BPE trained with `tokenizers` on data/corpus.txt.

Training takes about a second, but its output could drift between `tokenizers` versions, so the
trained file is shipped as data/tokenizer.json and copied into every tiny checkpoint: all tiny
checkpoints (and both tiny presets) share one vocabulary on every machine.
`python -m volundr.converter train-tokenizer` retrains it from the corpus.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

DATA_DIR = Path(__file__).resolve().parent / "data"
CORPUS_PATH = DATA_DIR / "corpus.txt"
TOKENIZER_PATH = DATA_DIR / "tokenizer.json"
VOCAB_SIZE = 4096

# Order fixes the ids: <|endoftext|> is 0 (the pad id and Engram's pad id).
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
]


def train_tokenizer(text: str, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE over `text`; special tokens first (ids 0..11), then the 256 bytes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,  # a small corpus: reach the full vocab_size
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Split on blank lines so that the specials inside chat samples are not merged into words.
    docs = [d for d in text.split("\n\n") if d]
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def train_from_corpus(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    return train_tokenizer(CORPUS_PATH.read_text(encoding="utf-8"), vocab_size)


def tokenizer_json() -> str:
    """The shipped tokenizer.json text (trained from the corpus if the file is missing)."""
    if TOKENIZER_PATH.exists():
        return TOKENIZER_PATH.read_text(encoding="utf-8")
    text = train_from_corpus().to_str(pretty=True)
    try:
        TOKENIZER_PATH.write_text(text, encoding="utf-8")
    except OSError:  # a read-only install: train again next time
        pass
    return text


def load_tokenizer(model_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a checkpoint directory (or the shipped one when `model_dir` is None)."""
    if model_dir is None:
        return Tokenizer.from_str(tokenizer_json())
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def special_ids(tok: Tokenizer) -> dict[str, int]:
    out = {}
    for s in SPECIAL_TOKENS:
        i = tok.token_to_id(s)
        if i is None:
            raise ValueError(f"tokenizer has no special token {s}")
        out[s] = i
    return out
