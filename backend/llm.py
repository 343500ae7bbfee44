"""User-facing offline API: `LLM(model_dir).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer

from volundr.engine import EngineConfig, LLMEngine, RequestOutput, kv_cache_torch_dtype
from volundr.sampling_params import SamplingParams
from volundr.session import DEFAULT_SESSION_GIB
from volundr.structured import Grammars


def _default_kv_blocks(cfg, device: torch.device, gpu_gib: float | None, max_num_seqs: int,
                       max_num_batched_tokens: int, max_model_len: int, block_size: int,
                       tp: int = 1, kv_dtype: torch.dtype = torch.bfloat16,
                       draft_cfg=None) -> int:
    """KV pool size: on CUDA what the memory plan leaves for KV under the budget (per GPU:
    with tensor parallelism the plan of one rank's share, `gpu_gib` on each of the tp GPUs),
    at kv_dtype's width (fp8: twice the tokens of bf16); on the CPU room for every sequence at
    full length. With a drafter (draft_cfg) its weights, its states, the copies of its states
    that a speculative step keeps, the check graphs' logits and its KV beside the model's per
    token come out of the same budget."""
    per_seq = (max_model_len + block_size - 1) // block_size
    if device.type != "cuda":
        return max_num_seqs * per_seq
    from volundr.memory import kv_bytes_per_token, plan_memory, state_bytes_per_seq, weight_bytes

    if gpu_gib is None:
        free, _ = torch.cuda.mem_get_info(device)
        gpu_gib = 0.9 * free / 2**30
    from volundr.model.parallel import rank_config

    dkv, gib = 0, gpu_gib  # gib: what the model's own plan gets
    if draft_cfg is not None:
        from volundr.model_runner import MAX_CHECK_LEN, MAX_CHECK_SEQS

        checked = min(max_num_seqs, MAX_CHECK_SEQS)  # sequences of a speculative step at most
        fixed = (weight_bytes(draft_cfg)[0]
                 + (max_num_seqs + checked) * state_bytes_per_seq(draft_cfg)
                 + checked * MAX_CHECK_LEN * cfg.vocab_size * 4)  # fp32 logits of every row
        gib, dkv = gpu_gib - fixed / 2**30, kv_bytes_per_token(draft_cfg, kv_dtype.itemsize)
        if gib <= 0:
            raise ValueError(f"the drafter alone needs {fixed / 2**30:.1f} GiB of the "
                             f"{gpu_gib:g} GiB GPU budget")
    plan = plan_memory(rank_config(cfg, tp), gib, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, kv_dtype=kv_dtype)
    if dkv:  # the pool's tokens hold both models' KV
        kv = plan.kv_bytes_per_token
        plan = dataclasses.replace(plan, kv_gpu_tokens=plan.kv_gpu_tokens * kv // (kv + dkv))
    if not plan.fits:
        raise ValueError(f"the model does not fit a {gpu_gib:.1f} GiB GPU budget:\n"
                         f"{plan.describe()}")
    blocks = min(plan.kv_gpu_tokens // block_size, max_num_seqs * per_seq)
    if blocks < per_seq:
        warnings.warn(f"a {gpu_gib:g} GiB budget holds {blocks * block_size} tokens of attention "
                      f"KV; the context is capped to that (asked for {max_model_len})",
                      stacklevel=3)
    return blocks


class LLM:
    def __init__(self, model: str | Path, device: str | None = None,
                 dtype: torch.dtype | None = None, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, max_model_len: int | None = None,
                 block_size: int = 16, gpu_gib: float | None = None,
                 num_kv_blocks: int | None = None, seed: int = 0,
                 tensor_parallel_size: int = 1, decode_steps: int = 1,
                 kv_cache_dtype: str = "auto", session_gib: float = DEFAULT_SESSION_GIB,
                 draft_model: str | Path | None = None,
                 num_speculative_tokens: int | None = None,
                 spec_min_tokens: float | None = None):
        """tensor_parallel_size N > 1: N ranks, one process per device (cuda:0..N-1, or N CPU
        processes over gloo); call `close()` (or use `with LLM(...)`) to stop them early —
        they also stop at exit. Scripts must guard their entry point with
        `if __name__ == "__main__":` (the workers are spawned).
        decode_steps K > 1: decode-only steps produce up to K tokens per engine step, and
        greedy batches speculating with the MTP head up to K steps (EngineConfig.decode_steps).
        kv_cache_dtype: "auto" (the model dtype), "bf16" or "fp8" (e4m3: about twice the KV
        tokens in a GPU budget; EngineConfig.kv_cache_dtype).
        session_gib: host memory for parked sessions (add_request's session_id;
        volundr.session).
        draft_model: a drafter checkpoint (Volundr-Draft, the same tokenizer): requests then
        decode speculatively, num_speculative_tokens guesses checked per step (None:
        EngineConfig's default; volundr.speculative: greedy output unchanged, sampled output
        from the model's distribution; seeded sampled requests make plain seeded sampling's
        tokens); "mtp": the
        checkpoint's MTP head guesses them (speculate_mtp; default 1 a step, more by its block
        applied to its own output). spec_min_tokens: a sequence whose first 16 speculative
        steps made fewer tokens a step decodes plainly after them (None: EngineConfig's)."""
        from volundr.converter.loader import load_checkpoint, resolve_model_dir

        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)  # before any loading
        self.model_dir = resolve_model_dir(model)
        cfg, state_dict = load_checkpoint(self.model_dir, device="cpu")
        self.config = cfg
        self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.eos_token_ids = self._eos_ids(cfg)
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings,
                                 cfg.max_position_embeddings)
        draft = None
        if draft_model == "mtp":  # the checkpoint's own MTP head (volundr.speculative)
            draft = "mtp"
        elif draft_model is not None:
            draft = load_checkpoint(resolve_model_dir(draft_model), device="cpu")
        if num_kv_blocks is None:
            num_kv_blocks = _default_kv_blocks(cfg, dev, gpu_gib, max_num_seqs,
                                               max_num_batched_tokens, self.max_model_len,
                                               block_size, tensor_parallel_size, kv_dtype,
                                               draft[0] if isinstance(draft, tuple) else None)
            self.max_model_len = min(self.max_model_len, num_kv_blocks * block_size)
        ecfg = EngineConfig(device=str(dev), dtype=dtype, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=self.max_model_len, block_size=block_size,
                            num_kv_blocks=num_kv_blocks, seed=seed,
                            tensor_parallel_size=tensor_parallel_size, gpu_gib=gpu_gib,
                            decode_steps=decode_steps, kv_cache_dtype=kv_cache_dtype,
                            session_gib=session_gib,
                            **({} if num_speculative_tokens is None
                               else {"num_speculative_tokens": num_speculative_tokens}),
                            **({} if spec_min_tokens is None
                               else {"spec_min_tokens": spec_min_tokens}))
        grammars = Grammars(self.model_dir / "tokenizer.json", cfg.vocab_size, self.eos_token_ids)
        self.engine = LLMEngine(cfg, state_dict, ecfg, self.eos_token_ids, draft, grammars)
        del state_dict, draft

    def close(self) -> None:
        """Stops tensor-parallel workers (a no-op on one device)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _eos_ids(self, cfg) -> tuple[int, ...]:
        ids = list(cfg.eos_token_id)
        gen = self.model_dir / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id", [])
            ids += eos if isinstance(eos, list) else [eos]
        return tuple(dict.fromkeys(int(i) for i in ids))

    # ---- request level (one thread drives these) ----------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None,
                    input_embeds: dict[int, torch.Tensor] | None = None,
                    session_id: str | None = None, priority: int = 0,
                    grammar=None) -> str:
        """input_embeds: prompt position -> [hidden] vector replacing that token's embedding;
        session_id: resume / park the session's state; priority: lower is admitted first;
        grammar: a structured request's matcher from `compile_grammar` (LLMEngine.add_request)."""
        return self.engine.add_request(prompt_token_ids, params, request_id, input_embeds,
                                       session_id, priority, grammar)

    def compile_grammar(self, params: SamplingParams):
        """LLMEngine.compile_grammar (any thread), for add_request."""
        return self.engine.compile_grammar(params)

    def close_session(self, session_id: str) -> bool:
        """Drops the session's parked state; whether there was one."""
        return self.engine.close_session(session_id)

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def stats(self) -> dict[str, int]:
        return self.engine.stats()

    # ---- batch level ----------------------------------------------------------------------
    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False).ids
        return list(prompt)

    def stream(self, prompts: list[str] | list[list[int]],
               params: SamplingParams | list[SamplingParams]) -> Iterator[list[RequestOutput]]:
        """Adds every prompt at once (one batch); yields each step's outputs."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            self.add_request(self._encode(prompt), p, request_id=f"gen-{i}")
        while self.has_unfinished():
            outs = self.step()
            if outs:
                yield outs

    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[dict]:
        """Runs all prompts as one continuous batch; returns {prompt, token_ids, text} each."""
        params = params or SamplingParams()
        ids: dict[str, list[int]] = {f"gen-{i}": [] for i in range(len(prompts))}
        for outs in self.stream(prompts, params):
            for o in outs:
                ids[o.request_id].extend(o.new_token_ids)
        return [{"prompt": p, "token_ids": ids[f"gen-{i}"],
                 "text": self.tokenizer.decode(ids[f"gen-{i}"])}
                for i, p in enumerate(prompts)]
