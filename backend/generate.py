"""python -m volundr.generate --model DIR --prompt TEXT [--prompt TEXT ...] --max-tokens N

All prompts run as one batch. With --json, prints one JSON object per prompt, in order:
{"prompt", "token_ids", "text"}.
"""

from __future__ import annotations

import argparse
import json
import sys

from volundr.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m volundr.generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory or Hugging Face repo id")
    ap.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--gpu-gib", type=float, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", choices=("auto", "bf16", "fp8"), default="auto",
                    help="attention KV cache: auto (the model dtype), bf16, or fp8 (e4m3: about "
                    "twice the KV tokens in a GPU budget)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel ranks: GPUs cuda:0..N-1 (or N CPU processes)")
    ap.add_argument("--json", action="store_true", help="one JSON object per prompt")
    args = ap.parse_args(argv)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                seed=args.seed, ignore_eos=args.ignore_eos,
                                presence_penalty=args.presence_penalty,
                                frequency_penalty=args.frequency_penalty,
                                repetition_penalty=args.repetition_penalty)
    except ValueError as e:
        ap.error(str(e))
    if args.tp < 1:
        ap.error("--tp must be >= 1")
    from volundr.distributed import WorkerError
    from volundr.llm import LLM

    try:
        with LLM(args.model, device=args.device, gpu_gib=args.gpu_gib,
                 max_num_seqs=max(1, len(args.prompt)), max_model_len=args.max_model_len,
                 tensor_parallel_size=args.tp, kv_cache_dtype=args.kv_cache_dtype) as llm:
            results = llm.generate(args.prompt, params)
    except (ValueError, FileNotFoundError, WorkerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in results:
        if args.json:
            print(json.dumps(r, ensure_ascii=False))
        else:
            print(f"--- {r['prompt']!r}\n{r['text']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
