"""`python -m volundr.converter {tiny,inspect,quantize,corpus,train-tokenizer} ...`"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m volundr.converter",
                                 description="Volundr checkpoint tools.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("tiny", help="write a tiny random checkpoint directory")
    t.add_argument("out_dir")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--preset", choices=["tiny", "draft-tiny"], default="tiny")

    i = sub.add_parser("inspect", help="architecture, parameter counts and memory plan")
    i.add_argument("model_dir", nargs="?", help="checkpoint directory (config.json is enough)")
    i.add_argument("--preset", help="inspect a named preset instead of a directory")
    i.add_argument("--gpu-gib", type=float, default=None, help="GPU memory budget in GiB")
    i.add_argument("--max-num-seqs", type=int, default=1)
    i.add_argument("--max-num-batched-tokens", type=int, default=512)
    i.add_argument("--kv-cache-dtype", choices=("auto", "bf16", "fp8"), default="auto",
                   help="the attention KV cache's dtype in the plan (auto: bf16)")
    i.add_argument("--json", action="store_true", help="print one JSON object")

    from volundr.converter.quantize import add_arguments as quantize_arguments

    quantize_arguments(sub.add_parser("quantize",
                                      help="write a mixed 2/3/4-bit volundr-mixed checkpoint"))
    sub.add_parser("corpus", help="rewrite converter/data/corpus.txt from corpus.py")
    sub.add_parser("train-tokenizer", help="retrain converter/data/tokenizer.json from the corpus")

    args = ap.parse_args(argv)
    if args.cmd == "tiny":
        from volundr.converter.tiny import build_tiny

        out = build_tiny(args.out_dir, seed=args.seed, preset=args.preset)
        print(f"wrote {args.preset} checkpoint (seed {args.seed}) to {out}")
        return 0
    if args.cmd == "inspect":
        from volundr.config import ConfigError
        from volundr.converter.summary import inspect_main

        try:
            return inspect_main(args)
        except (ConfigError, FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.cmd == "quantize":
        from volundr.converter.quantize import run as quantize_run

        return quantize_run(args)
    if args.cmd == "corpus":
        from volundr.converter.corpus import build_corpus
        from volundr.converter.tokenizer import CORPUS_PATH

        CORPUS_PATH.write_text(build_corpus(), encoding="utf-8")
        print(f"wrote {CORPUS_PATH}")
        return 0
    if args.cmd == "train-tokenizer":
        from volundr.converter.tokenizer import TOKENIZER_PATH, train_from_corpus

        tok = train_from_corpus()
        TOKENIZER_PATH.write_text(tok.to_str(pretty=True), encoding="utf-8")
        print(f"wrote {TOKENIZER_PATH} ({tok.get_vocab_size()} tokens)")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
