"""The engine: `step()` = schedule -> run -> postprocess, over continuously batched requests."""

from __future__ import annotations

import hashlib
import itertools
import uuid
from dataclasses import dataclass

import torch

from volundr.block_manager import BlockManager, StateSlots
from volundr.config import VolundrConfig
from volundr.distributed import TensorParallelRunner, WorkerError
from volundr.model_runner import MAX_CHECK_LEN, ModelRunner
from volundr.sampling_params import SamplingParams
from volundr.scheduler import ScheduledSeq, Scheduler
from volundr.sequence import Sequence
from volundr.session import DEFAULT_SESSION_GIB, ParkedSession, SessionStore
from volundr.speculative import mtp_after_run, speculate, speculate_mtp
from volundr.step_plan import SPEC_TRIAL_STEPS, StepPlan
from volundr.structured import Grammars, completes_at

# EngineConfig.kv_cache_dtype -> the cache's torch dtype (None: the model's). fp8 is the e4m3
# format the attention kernels store and read (volundr.kernels.attention.cache.FP8), unscaled.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The attention KV cache's dtype for an EngineConfig.kv_cache_dtype ("auto": model_dtype);
    ValueError for an unknown name."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not "
                         f"{kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


# EngineConfig.num_speculative_tokens's defaults: a drafter's guesses a step, and the MTP
# head's (a guess from its block applied to its own output is right less often; a step of one
# guess costs 1.48x a plain one, k = 2 / 3 1.67x / 1.82x: H100, session 29)
DRAFT_TOKENS, MTP_TOKENS = 4, 1


@dataclass(frozen=True)
class EngineConfig:
    device: str
    dtype: torch.dtype
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    block_size: int = 16
    num_kv_blocks: int = 0
    seed: int = 0
    cuda_graphs: bool = True  # capture the decode step on CUDA
    tensor_parallel_size: int = 1  # ranks (devices), one process each: volundr.distributed
    gpu_gib: float | None = None  # hard cap on each rank's CUDA allocator (the memory plan's)
    # Decode-only steps run up to this many tokens per engine step, the next input fed on the
    # device (ModelRunner.run_decode_steps): the host enqueues them all and syncs once. With
    # the MTP head a batch takes up to this many speculative steps so (StepPlan.spec_steps).
    decode_steps: int = 1
    # The attention KV cache (main and MTP layers; KDA and conv states keep theirs): "auto" (the
    # model dtype), "bf16" / "bfloat16", "fp8" / "fp8_e4m3" (half the bytes of bf16 per token).
    kv_cache_dtype: str = "auto"
    # Host memory for parked sessions (volundr.session): a finished request with a session id
    # keeps its state there until its next turn; 0 turns sessions off. With tensor parallelism
    # this bounds rank 0's copy (every rank parks its own shard).
    session_gib: float = DEFAULT_SESSION_GIB
    # Speculative decoding (volundr.speculative; with a drafter given to LLMEngine): the
    # guesses checked per decode step; None: DRAFT_TOKENS with a drafter, MTP_TOKENS with the
    # MTP head (its block applied to its own output for each guess after the first).
    num_speculative_tokens: int | None = None
    # A sequence whose speculative steps made fewer tokens than this a step on average, after
    # SPEC_TRIAL_STEPS of them, decodes plainly from then on: a step checking k guesses costs
    # 1.48x (k = 1) to 2.3x (k = 6) a plain one (H100, session 29), so a drafter that rarely
    # guesses right loses (random weights' MTP head: 0.69x). 0: never stop.
    spec_min_tokens: float = 1.3

    def __post_init__(self) -> None:
        kv_cache_torch_dtype(self.kv_cache_dtype, self.dtype)  # a clear ValueError if unknown
        if (self.num_speculative_tokens or 1) > MAX_CHECK_LEN - 1:
            raise ValueError(f"num_speculative_tokens must be at most {MAX_CHECK_LEN - 1}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                     "num_kv_blocks", "tensor_parallel_size", "decode_steps",
                     "num_speculative_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.session_gib < 0:
            raise ValueError("session_gib must be >= 0")
        if self.spec_min_tokens < 0:
            raise ValueError("spec_min_tokens must be >= 0")
        if self.num_kv_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV pool ({self.num_kv_blocks} blocks of {self.block_size} tokens) cannot "
                f"hold one sequence of max_model_len={self.max_model_len} tokens")

    @property
    def kv_dtype(self) -> torch.dtype:
        """The attention KV cache's torch dtype."""
        return kv_cache_torch_dtype(self.kv_cache_dtype, self.dtype)


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens restored from the session's parked state
    # with params.logprobs: one (logprob, [(id, logprob)] alternatives) per new token
    new_logprobs: list | None = None


class LLMEngine:
    def __init__(self, cfg: VolundrConfig, state_dict: dict[str, torch.Tensor],
                 ecfg: EngineConfig, eos_token_ids: tuple[int, ...],
                 draft: tuple[VolundrConfig, dict[str, torch.Tensor]] | str | None = None,
                 grammars: Grammars | None = None):
        """draft = (config, weights) of a drafter (Volundr-Draft: the same vocabulary): decode
        steps then check ecfg.num_speculative_tokens of its guesses at once
        (volundr.speculative); "mtp": the checkpoint's MTP head guesses them
        (speculate_mtp). grammars: compiles requests' json_schema / grammar over the model's
        tokenizer (volundr.structured; None: such requests are refused)."""
        self.cfg, self.ecfg = cfg, ecfg
        self.mtp = draft == "mtp"
        if self.mtp:
            if not cfg.mtp.num_layers:
                raise ValueError("draft 'mtp': this checkpoint has no MTP block")
            draft = None
        # guesses a step; tokens per sequence of a speculative check (t_0 and the guesses), 0:
        # no drafter
        self.spec_k = ecfg.num_speculative_tokens or (MTP_TOKENS if self.mtp else DRAFT_TOKENS)
        self.check_len = self.spec_k + 1 if self.mtp or draft is not None else 0
        if self.check_len and ecfg.tensor_parallel_size > 1:
            raise ValueError("speculative decoding does not run with tensor parallelism yet")
        if draft is not None and draft[0].vocab_size != cfg.vocab_size:
            raise ValueError(f"the drafter's vocabulary ({draft[0].vocab_size}) is not the "
                             f"model's ({cfg.vocab_size})")
        if ecfg.tensor_parallel_size > 1:
            self.runner = TensorParallelRunner(
                cfg, state_dict, torch.device(ecfg.device), ecfg.dtype, ecfg.max_num_seqs,
                ecfg.num_kv_blocks, ecfg.block_size, ecfg.seed, ecfg.max_model_len,
                tp=ecfg.tensor_parallel_size, gpu_budget_gib=ecfg.gpu_gib,
                cuda_graphs=ecfg.cuda_graphs, kv_dtype=ecfg.kv_dtype)
        else:
            self.runner = ModelRunner(cfg, state_dict, torch.device(ecfg.device), ecfg.dtype,
                                      ecfg.max_num_seqs, ecfg.num_kv_blocks, ecfg.block_size,
                                      ecfg.seed, ecfg.max_model_len, ecfg.cuda_graphs,
                                      gpu_budget_gib=ecfg.gpu_gib, kv_dtype=ecfg.kv_dtype,
                                      check_len=self.check_len, mtp_graphs=self.mtp)
        self.runner.keep_hidden = self.mtp  # (MTP drafts read the forwards' hidden states)
        self.drafter = None
        # speculative steps, the sequences they ran (a sequence per step), the tokens they made
        self.spec_steps = self.spec_seqs = self.spec_tokens = 0
        self.spec_stopped = 0  # sequences that stopped speculating (spec_min_tokens)
        if draft is not None:
            dcfg, dsd = draft
            # the same slots and block tables as the model: its own states and KV cache (after
            # the model's runner: its GPU budget caps the drafter's allocations too)
            self.drafter = ModelRunner(dcfg, dsd, torch.device(ecfg.device), ecfg.dtype,
                                       ecfg.max_num_seqs, ecfg.num_kv_blocks, ecfg.block_size,
                                       ecfg.seed, ecfg.max_model_len, ecfg.cuda_graphs,
                                       kv_dtype=ecfg.kv_dtype, check_len=self.check_len,
                                       check_logits=False)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.grammars = grammars
        self.block_manager = BlockManager(ecfg.num_kv_blocks, ecfg.block_size)
        self.slots = StateSlots(ecfg.max_num_seqs)
        self.scheduler = Scheduler(self.block_manager, self.slots, ecfg.max_num_seqs,
                                   ecfg.max_num_batched_tokens)
        self.plan = StepPlan(ecfg, self.scheduler, self.slots, self.block_manager,
                             self.spec_k if self.check_len else 0, self.mtp,
                             getattr(self.runner, "max_check_seqs", 0))
        self.requests: dict[str, Sequence] = {}
        self.sessions = SessionStore(int(ecfg.session_gib * 2**30), self._forget)
        self._tickets = itertools.count()

    def _forget(self, ticket: int) -> None:
        """Frees a parked session's tensors (the model's and the drafter's)."""
        self.runner.forget(ticket)
        if self.drafter is not None:
            self.drafter.forget(ticket)

    def _restore_drafter(self, batch: list[ScheduledSeq]) -> None:
        """Sequences whose parked session the model restores in this step: the drafter's
        parked state too, where the session kept one (the turn's end), so that it catches up
        from there, not from the first token."""
        for item in batch:
            s, r = item.seq, item.seq.resume
            if r is None:
                continue
            if r.draft_tokens:
                self.drafter.restore(s.slot, s.block_table, r, r.draft_tokens)
                s.num_draft_computed = r.draft_tokens
            else:
                self.drafter.forget(r.ticket)

    def compile_grammar(self, params: SamplingParams):
        """A structured request's matcher (volundr.structured.Grammars.matcher; safe on any
        thread), None for a free one. ValueError: a grammar that does not compile, or no
        grammars in this engine."""
        if not params.structured:
            return None
        if self.grammars is None:
            raise ValueError("structured output: this engine has no tokenizer for grammars")
        return self.grammars.matcher(params)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None,
                    input_embeds: dict[int, torch.Tensor] | None = None,
                    session_id: str | None = None, priority: int = 0,
                    grammar=None) -> str:
        """input_embeds: prompt position -> [hidden] vector used instead of that token's
        embedding (image patches from a vision tower, for example). session_id: resume the
        session's parked state if this prompt extends its tokens, and park this request's
        state under it when it ends (volundr.session). priority: waiting requests are admitted
        lower values first (then in arrival order); under KV pressure the highest value is
        preempted first. grammar: a structured request's matcher compiled already
        (`compile_grammar` on another thread: a large schema takes milliseconds, which the
        engine's thread would take from every running stream); None: compiled here."""
        if isinstance(self.runner, TensorParallelRunner):
            self.runner.check()  # WorkerError once a rank is gone
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.ecfg.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's context is "
                             f"{self.ecfg.max_model_len} tokens, including the output")
        if any(t < 0 or t >= self.cfg.vocab_size for t in ids):
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size})")
        if any(t >= self.cfg.vocab_size for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {self.cfg.vocab_size})")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        seq = Sequence(request_id, ids, params)
        seq.stop_ids = self._stop_ids(seq)
        if params.structured:
            seq.grammar = grammar if grammar is not None else self.compile_grammar(params)
        seq.priority = int(priority)
        for pos, vec in (input_embeds or {}).items():
            if not 0 <= pos < len(ids):
                raise ValueError(f"input embedding at position {pos} is outside the prompt "
                                 f"(0..{len(ids) - 1})")
            if tuple(vec.shape) != (self.cfg.hidden_size,):
                raise ValueError(f"input embedding at position {pos} has shape "
                                 f"{tuple(vec.shape)}, expected ({self.cfg.hidden_size},)")
            seq.input_embeds[int(pos)] = vec.detach().to("cpu")
        if session_id:
            seq.session_id = session_id
            seq.embed_digests = {p: hashlib.sha1(v.float().numpy().tobytes()).hexdigest()
                                 for p, v in seq.input_embeds.items()}
            seq.resume = self.sessions.take(session_id, ids, seq.embed_digests)
            if seq.resume is not None:
                seq.num_computed_tokens = seq.num_cached_tokens = seq.resume.num_tokens
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self._release_session(seq)
        self.scheduler.finish(seq, "abort")
        return True

    def close_session(self, session_id: str) -> bool:
        """Drops the session's parked state (its host memory); whether there was one."""
        return self.sessions.drop(session_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        if self.drafter is not None:
            self._restore_drafter(batch)
        k, spec = self.plan.speculative(batch)
        outs: list[RequestOutput] = []
        if k:  # the speculative decodes, then the rest of the batch in a forward of its own
            if self.mtp:  # [seq][step] tokens
                steps = speculate_mtp(self.runner, spec, k, self._counted, self._limits,
                                      self.plan.spec_steps(spec, k, batch))
            else:
                steps = [[t] for t in speculate(self.runner, self.drafter, spec, k,
                                                self.check_len,
                                                self.ecfg.max_num_batched_tokens,
                                                self._counted)]
            self.spec_steps += max(map(len, steps))
            tokens = [[t for toks in st for t in toks] for st in steps]
            for item, st, toks in zip(spec, steps, tokens):
                seq = item.seq
                seq.spec_steps += len(st)
                seq.spec_tokens += len(toks)
                self.spec_seqs += len(st)
                self.spec_tokens += len(toks)
                self.spec_stopped += (seq.spec_steps == SPEC_TRIAL_STEPS
                                      and not self.plan.pays(seq))
            outs = self._postprocess_steps(spec, tokens)
            batch = [it for it in batch if it not in spec]
            if not batch:
                return outs
        steps = 1 if k else self.plan.decode_steps(batch)
        try:
            if steps > 1:
                stops = None  # a session's slot must not take in tokens after its stop
                if self.sessions.capacity_bytes and any(it.seq.session_id for it in batch):
                    stops = [self._stop_ids(it.seq) for it in batch]
                rows = self.runner.run_decode_steps(batch, steps, stops)
                for item in batch:  # (no hidden states kept: no MTP drafts)
                    item.seq.mtp_drafts = []
                return self._postprocess_steps(
                    batch, [[row[i] for row in rows] for i in range(len(batch))])
            tokens = self.runner.run(batch)
            if self.mtp:
                mtp_after_run(self.runner, batch, tokens)
            self._save_prompt_states(batch)
            return outs + self._postprocess(batch, tokens)  # (parks sessions: a rank may fail)
        except WorkerError:  # a tensor-parallel rank is gone: fail every request, stay failed
            for rid in list(self.requests):
                self.abort(rid)
            raise

    def _end_reason(self, seq: Sequence, tok: int) -> str | None:
        """Why seq ends at `tok`, its newest token ("stop": a stop or eos token, or the last
        token of its structured output; "length"), or None."""
        if tok in self._stop_ids(seq):
            return "stop"
        if seq.grammar is not None and seq.grammar.is_stopped():
            return "stop"  # the value is complete: nothing but EOS can follow
        if (seq.num_output_tokens >= seq.params.max_tokens
                or seq.num_tokens >= self.ecfg.max_model_len):
            return "length"
        return None

    def _limits(self, seq: Sequence) -> tuple[int, tuple[int, ...]]:
        """`_end_reason`'s rules for tokens appended to seq: (how many it may take before the
        last one ends it by length, the ids that stop it)."""
        return (max(1, min(seq.params.max_tokens - seq.num_output_tokens,
                           self.ecfg.max_model_len - seq.num_tokens)), self._stop_ids(seq))

    def _counted(self, seq: Sequence, tokens: list[int]) -> int:
        """How many of `tokens`, appended to seq one by one, it takes (`_end_reason`)."""
        cap, stops = self._limits(seq)
        n = next((j + 1 for j, t in enumerate(tokens) if t in stops or j + 1 >= cap),
                 len(tokens))
        return n if seq.grammar is None else completes_at(seq.grammar, tokens[:n])

    def _postprocess_steps(self, batch: list[ScheduledSeq],
                           tokens: list[list[int]]) -> list[RequestOutput]:
        """tokens[i]: batch[i]'s tokens of this step, each postprocessed as a one-token step;
        a sequence that stops drops the rest of its tokens (computed, never emitted). One
        merged output per request."""
        merged: dict[str, RequestOutput] = {}
        alive = [(i, it) for i, it in enumerate(batch) if tokens[i]]
        for j in range(max(map(len, tokens), default=0)):
            outs = self._postprocess([ScheduledSeq(it.seq, 1) for _, it in alive],
                                     [tokens[i][j] for i, _ in alive])
            for o in outs:
                prev = merged.get(o.request_id)
                merged[o.request_id] = o if prev is None else RequestOutput(
                    o.request_id, prev.new_token_ids + o.new_token_ids, o.finished,
                    o.finish_reason, o.num_prompt_tokens, o.num_output_tokens,
                    o.num_cached_tokens, None if o.new_logprobs is None
                    else (prev.new_logprobs or []) + o.new_logprobs)
            alive = [(i, it) for i, it in alive
                     if not merged[it.seq.request_id].finished and j + 1 < len(tokens[i])]
            if not alive:
                break
        return list(merged.values())

    def _postprocess(self, batch: list[ScheduledSeq], tokens: list[int]) -> list[RequestOutput]:
        outs, it = [], iter(tokens)
        for item in batch:
            seq, samples = item.seq, item.samples  # `samples` reads num_computed_tokens
            seq.num_computed_tokens += item.num_new_tokens
            if not samples:
                continue
            tok = next(it)
            seq.token_ids.append(tok)
            if seq.grammar is not None:
                seq.grammar.consume_token(tok)  # (a token it refuses: only EOS allowed next)
            reason = self._end_reason(seq, tok)
            new = seq.token_ids[seq.num_prompt_tokens + seq.num_emitted:]  # (no copy of all)
            if reason == "stop" and tok in self._stop_ids(seq):  # ends it without being emitted
                new = new[:-1]
            lps = (seq.logprobs[seq.num_emitted:seq.num_emitted + len(new)]
                   if seq.params.logprobs is not None else None)
            seq.num_emitted += len(new)
            if reason is not None:
                self._park(seq)
                self.scheduler.finish(seq, reason)
                self.requests.pop(seq.request_id, None)
            outs.append(RequestOutput(seq.request_id, new, reason is not None, reason,
                                      seq.num_prompt_tokens, seq.num_output_tokens,
                                      seq.num_cached_tokens, lps))
        return outs

    def _save_prompt_states(self, batch: list[ScheduledSeq]) -> None:
        """A session request whose prompt just ran to its end: its state then, kept for the
        park (volundr.session: the next turn may share the prompt but not the reply)."""
        if not self.sessions.capacity_bytes:
            return
        for item in batch:
            s = item.seq
            if (s.session_id and item.samples and s.num_output_tokens == 0
                    and s.num_prompt_tokens > s.num_cached_tokens):
                self.runner.snap(s.seq_id, s.slot)
                s.prompt_snap = True

    def _stop_ids(self, seq: Sequence) -> tuple[int, ...]:
        """The tokens that end seq (hidden: never emitted)."""
        p = seq.params
        return p.stop_token_ids + (() if p.ignore_eos else tuple(self.eos_token_ids))

    def _park(self, seq: Sequence) -> None:
        """A finished session request's state to host memory, under its session id. Its
        last sampled token never ran through the model: the state covers the tokens before.
        With its prompt's state when the turn ran past its prompt (volundr.session)."""
        if not seq.session_id or not self.sessions.capacity_bytes:
            return self._release_session(seq)
        n = seq.num_computed_tokens
        with_prompt = seq.prompt_snap and n > seq.num_prompt_tokens
        nb = self.block_manager.blocks_for(n)
        d = min(seq.num_draft_computed, n) if self.drafter is not None else 0
        nbd = self.block_manager.blocks_for(d)
        need = self.runner.session_nbytes(nb, with_prompt)
        if d:
            need += self.drafter.session_nbytes(nbd)
        if not self.sessions.fits(need):
            self.sessions.drop(seq.session_id)
            return self._release_session(seq)
        ticket = next(self._tickets)
        nbytes = self.runner.park(ticket, seq.slot, seq.block_table[:nb],
                                  seq.seq_id if with_prompt else None)
        if d:  # the drafter's state too: the next turn's catch-up starts at d, not at 0
            nbytes += self.drafter.park(ticket, seq.slot, seq.block_table[:nbd], None)
        if seq.prompt_snap and not with_prompt:
            self.runner.unsnap(seq.seq_id)
        seq.prompt_snap = False
        self.sessions.put(seq.session_id, ParkedSession(
            seq.token_ids[:n], ticket, nbytes, seq.num_prompt_tokens if with_prompt else 0,
            {p: dg for p, dg in seq.embed_digests.items() if p < n}, d))

    def _release_session(self, seq: Sequence) -> None:
        """The runner's copies a request ends without using: its prompt's state, a parked
        state it took but never restored."""
        if seq.prompt_snap:
            self.runner.unsnap(seq.seq_id)
            seq.prompt_snap = False
        if seq.resume is not None:
            self._forget(seq.resume.ticket)
            seq.resume = None

    def close(self) -> None:
        """Stops the tensor-parallel workers (a no-op on one device); also runs at exit."""
        if isinstance(self.runner, TensorParallelRunner):
            self.runner.close()

    def stats(self) -> dict[str, int]:
        return {
            "num_blocks_total": self.block_manager.num_blocks,
            "num_blocks_free": self.block_manager.num_free,
            "num_slots_total": self.slots.num_slots,
            "num_slots_free": self.slots.num_free,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            **self.sessions.stats(),
            "spec_steps": self.spec_steps,
            "spec_seqs": self.spec_seqs,
            "spec_tokens": self.spec_tokens,
            "spec_stopped": self.spec_stopped,
        }
