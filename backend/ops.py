"""The one place that decides which implementation of each op the engine runs.

CUDA tensors take the Triton kernels of `volundr.kernels.<op>` (their `engine.py` modules);
CPU tensors, or `VOLUNDR_NAIVE=1` (or a comma list of the ops to take so), take the naive
PyTorch references. The model calls only the
functions below, so swapping a kernel never touches model code.

Shapes (T tokens of N sequences packed; `cu_seqlens` [N + 1] int32 splits them):
  kda_mixer   q, k [T, H, K] (pre-L2-norm), v [T, H, V], gate logits [T, H, K], beta logits [T, H],
              state [slots, H, K, V] fp32 updated in place at `slot_ids` [N].
  causal_conv x [T, C], weight [C, W], conv_state [slots, C, W - 1] updated in place.
  kda_decode  a decode step (T == N) of both: qkv [T, 3HK] raw, one launch on CUDA.
  kda_rows    a speculative check's few rows a sequence of both, or its commit, one launch on
              CUDA.
  attention   q [T, Hq, D]; k_cache/v_cache [blocks, block_size, Hkv, D].
  lookups     ids [T, m] long (the n-gram window of each token, the token last); host tables.
  spec_*      a greedy speculative step's work between its graph replays (kernels/spec):
              accept_rows, chain_rows, next_rows, in place into the graphs' buffers.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from volundr.kernels.attention.naive import naive_paged_attention, naive_store_kv
from volundr.kernels.engram.naive import engram_rows, naive_lookup
from volundr.kernels.kda.naive import (
    kda_gate,
    naive_causal_conv1d,
    naive_chunk_kda,
    naive_recurrent_kda,
)
from volundr.kernels.norm.naive import naive_rms_norm, naive_rms_norm_gated, naive_swiglu
from volundr.kernels.spec import naive as spec_naive


@functools.cache
def _fast_module(name: str):
    """`volundr.kernels.<name>.engine` when kernels are enabled and that module exists
    (VOLUNDR_NAIVE=1: none are; a comma list of op names, e.g. `spec`: those are not)."""
    naive = os.environ.get("VOLUNDR_NAIVE", "0")
    if naive == "1" or name in naive.split(","):
        return None
    modname = f"volundr.kernels.{name}.engine"
    try:
        return importlib.import_module(modname)
    except ModuleNotFoundError as e:
        if e.name == modname:  # not written yet; any other missing import is a real error
            return None
        raise


def _fast(x: torch.Tensor, name: str):
    return _fast_module(name) if x.is_cuda else None


def kda_mixer(q, k, v, g_raw, beta_raw, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
              state: torch.Tensor, slot_ids: torch.Tensor, cu_seqlens: torch.Tensor,
              cu_list: list[int], scale: float, update_state: bool = True) -> torch.Tensor:
    """KDA over packed sequences with per-sequence recurrent state; returns o [T, H, V].
    The decay g = -exp(A_log) * softplus(g_raw + dt_bias) and beta = sigmoid(beta_raw) are
    applied inside the kernels on CUDA. update_state False: the states are read, not written
    (a speculative check). A negative slot id: a sequence that reads zeros and writes nothing
    (CUDA; the naive path reads and writes the last row, the runner's scratch slot)."""
    fast = _fast(q, "kda")
    if fast is not None:
        return fast.kda_mixer(q, k, v, g_raw, beta_raw, state, slot_ids, cu_seqlens, cu_list,
                              scale, A_log=A_log, dt_bias=dt_bias, update_state=update_state)
    g, beta = kda_gate(g_raw, A_log, dt_bias), torch.sigmoid(beta_raw.float())
    init = state[slot_ids]
    args = (q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0))
    decode = all(cu_list[i + 1] - cu_list[i] <= 1 for i in range(len(cu_list) - 1))
    fn = naive_recurrent_kda if decode else naive_chunk_kda
    o, final = fn(*args, scale=scale, initial_state=init, output_final_state=True,
                  cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
    if update_state:
        state[slot_ids] = final
    return o.squeeze(0)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                slot_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                activation: str | None = "silu", update_state: bool = True,
                max_len: int | None = None) -> torch.Tensor:
    """Depthwise causal conv (+ SiLU) over packed sequences, carrying each sequence's tail.
    update_state False: the tails are read, not written. max_len: a bound on the tokens per
    sequence, known on the host (a speculative check's few). A negative slot id: a sequence
    whose outputs are not computed (CUDA; the naive path takes the last row, the scratch slot)."""
    fast = _fast(x, "kda")
    if fast is not None and hasattr(fast, "causal_conv"):
        return fast.causal_conv(x, weight, conv_state, slot_ids, cu_seqlens, activation,
                                update_state=update_state, max_len=max_len)
    tails = conv_state[slot_ids]
    y = naive_causal_conv1d(x, weight, tails, cu_seqlens, activation)
    if update_state:
        conv_state[slot_ids] = tails
    return y


def kda_decode_takes_low_rank(x: torch.Tensor, T: int, conv_width: int, bits: int,
                              group_size: int, rank: int) -> bool:
    """Whether `kda_decode` takes `low_rank` for a step of T sequences (on CUDA, see
    kernels/kda/engine.py `decode_takes_low_rank`); x: any tensor on the step's device."""
    fast = _fast(x, "kda")
    return fast is not None and fast.decode_takes_low_rank(T, conv_width, bits, group_size, rank)


def kda_decode(qkv: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
               g_raw: torch.Tensor | None, beta_raw: torch.Tensor, state: torch.Tensor,
               slot_ids: torch.Tensor, cu_seqlens: torch.Tensor, cu_list: list[int],
               scale: float, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
               gated: tuple | None = None, low_rank: tuple | None = None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A KDA layer's decode step (one token per sequence, T == N; cu_seqlens / cu_list are
    arange(T + 1)): `causal_conv` (+ SiLU) over the raw q|k|v projections qkv [T, 3HK] (q, k, v
    each [H, K] per token) with conv_state, then `kda_mixer` with gate logits g_raw [T, H, K]
    and beta logits [T, H]; both states updated in place at slot_ids [T]. A negative slot id is
    a padding row: no state touched, and its o row is not to be used. Returns o [T, H, V].
    On CUDA one kernel does all of it at small batch (kernels/kda/engine.py `decode_fits`).
    gated = (gate [T, H, V] logits, norm weight [V]): returns (o w sigmoid(gate), ss [T, H, P]
    fp32 partial sums of o^2 per head), the gated output norm but its per-head 1 / rms (see
    `layers.GroupScaled`); the one kernel computes it in its epilogue.
    low_rank = (xs [T, 2R], qa, sz) of KDA's f_b / g_b (4-bit, kernels/kda/decode.py), with
    g_raw None and gated = (None, norm weight): the kernel computes the gate logits itself;
    only where `kda_decode_takes_low_rank` says so."""
    fast = _fast(qkv, "kda")
    if low_rank is not None:
        return fast.kda_decode(qkv, conv_weight, conv_state, None, beta_raw, state, slot_ids,
                               scale, A_log, dt_bias, gated=gated, low_rank=low_rank)
    T, (_, H, K), V = qkv.shape[0], g_raw.shape, state.shape[-1]
    if fast is not None and fast.decode_fits(T, conv_weight.shape[-1]):
        return fast.kda_decode(qkv, conv_weight, conv_state, g_raw, beta_raw, state, slot_ids,
                               scale, A_log, dt_bias, gated=gated)
    if gated is not None:  # the same from the ungated output
        o = kda_decode(qkv, conv_weight, conv_state, g_raw, beta_raw, state, slot_ids,
                       cu_seqlens, cu_list, scale, A_log, dt_bias).float()
        gate, w = gated
        u = o * w.float() * torch.sigmoid(gate.float())
        return u.to(qkv.dtype), o.pow(2).sum(-1, keepdim=True)
    live = slot_ids >= 0
    if fast is None and not bool(live.all()):
        # padding rows (the kernels skip them; the naive ops would index with -1): the live rows
        o = qkv.new_zeros(T, H, V)
        i = live.nonzero().squeeze(1)
        n = i.numel()
        cu = torch.arange(n + 1, dtype=torch.int32, device=qkv.device)
        o[i] = kda_decode(qkv[i], conv_weight, conv_state, g_raw[i], beta_raw[i], state,
                          slot_ids[i], cu, list(range(n + 1)), scale, A_log, dt_bias)
        return o
    y = causal_conv(qkv, conv_weight, conv_state, slot_ids, cu_seqlens, activation="silu")
    q, k = y[:, :H * K].view(T, H, K), y[:, H * K:2 * H * K].view(T, H, K)
    return kda_mixer(q, k, y[:, 2 * H * K:].view(T, H, V), g_raw, beta_raw, A_log, dt_bias,
                     state, slot_ids, cu_seqlens, cu_list, scale)


def kda_rows_fit(x: torch.Tensor, L: int, conv_width: int, K: int) -> bool:
    """Whether `kda_rows` takes a check of at most L rows a sequence, or its commit (CUDA; see
    kernels/kda/engine.py `rows_fit`); x: any tensor on the step's device."""
    fast = _fast(x, "kda")
    return fast is not None and fast.rows_fit(L, conv_width, K)


def kda_rows(qkv: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
             g_raw: torch.Tensor, beta_raw: torch.Tensor, state: torch.Tensor,
             slot_ids: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
             A_log: torch.Tensor, dt_bias: torch.Tensor | None, update: bool = False,
             gated: tuple | None = None):
    """A speculative check's conv + KDA in one launch (update False: returns o [T, H, V], the
    states read only) or its commit (update True: the states advanced over each sequence's
    rows), in check_layout's rows (cu_seqlens [2n + 1], slot_ids [2n]: each sequence, then its
    gap); what `causal_conv` then `kda_mixer` compute there. Only where `kda_rows_fit` says so
    (kernels/kda/rows.py). gated = (z, norm weight): a check's (o w sigmoid(z), ss) as
    `kda_decode`'s gated, the head's RMS scale left to o_proj."""
    return _fast(qkv, "kda").kda_rows(qkv, conv_weight, conv_state, g_raw, beta_raw, state,
                                      slot_ids, cu_seqlens, scale, A_log, dt_bias, update,
                                      gated=gated)


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    fast = _fast(k, "attention")
    if fast is not None:
        return fast.store_kv(k, v, k_cache, v_cache, slot_mapping)
    naive_store_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                    scale: float, max_q_len: int, max_context_len: int, k_new=None,
                    v_new=None) -> torch.Tensor:
    """Causal GQA attention of the new tokens over cache + themselves; o [T, Hq, D].
    k_new / v_new: the new tokens' K/V just stored (the CUDA prefill may read them directly)."""
    fast = _fast(q, "attention")
    if fast is not None:
        return fast.paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                    context_lens, scale, max_q_len, max_context_len, k_new,
                                    v_new)
    return naive_paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                 context_lens, scale)


def rms_norm(x, weight, eps: float, residual=None):
    """RMSNorm; with `residual`, returns (norm(x + residual), x + residual)."""
    fast = _fast(x, "norm")
    if fast is not None:
        return fast.rms_norm(x, weight, eps, residual)
    return naive_rms_norm(x, weight, eps, residual)


def rms_norm_gated(x, weight, gate, eps: float):
    """RMSNorm(x) * sigmoid(gate) over the last dim (KDA's output norm); x, gate [..., C]."""
    fast = _fast(x, "norm")
    if fast is not None:
        return fast.rms_norm_gated(x, weight, gate, eps)
    return naive_rms_norm_gated(x, weight, gate, eps)


def swiglu(gate, up):
    fast = _fast(gate, "norm")
    if fast is not None:
        return fast.swiglu(gate, up)
    return naive_swiglu(gate, up)


def _host_copy(x: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if device.type == "cuda":
        x = x.pin_memory().to(device, non_blocking=True)
    return x.to(device=device, dtype=dtype)


def embedding_lookup(ids: torch.Tensor, table: torch.Tensor, device: torch.device,
                     dtype: torch.dtype) -> torch.Tensor:
    """Rows of the host table [V, D] for the last column of ids [T, m] -> [T, D] on `device`.
    ids on CUDA (the table is then pinned): the GPU reads the rows in place; ids on the host:
    gathered on the host and copied."""
    fast = _fast(ids, "engram")
    if fast is not None:
        out = torch.empty(ids.shape[0], table.shape[1], device=ids.device, dtype=dtype)
        return fast.embedding_lookup(ids, table, out)
    return _host_copy(naive_lookup(ids[:, -1:].cpu(), [table]), device, dtype)


def engram_lookup(ids: torch.Tensor, tables: list[torch.Tensor], meta, cfg,
                  device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Engram's e_t [T, J * D] on `device` for ids [T, m]: hash (VOLUNDR.md) and gather the J
    host tables. On CUDA `meta` (volundr.model.engram.LookupMeta) describes the tables as one
    pinned buffer that the GPU reads in place; on the host `cfg` (EngramConfig) gives the hash."""
    fast = _fast(ids, "engram")
    if fast is not None:
        out = torch.empty(ids.shape[0], len(tables) * tables[0].shape[1], device=ids.device,
                          dtype=dtype)
        return fast.engram_lookup(ids, meta.table, meta.offsets, meta.sizes, meta.orders,
                                  meta.seeds, out)
    ids = ids.cpu()
    return _host_copy(naive_lookup(engram_rows(ids, cfg), tables), device, dtype)


def spec_ops(x: torch.Tensor):
    """The module whose accept_rows / chain_rows / next_rows a speculative step on x's device
    runs (volundr.kernels.spec: Triton on CUDA, naive.py elsewhere); shapes there."""
    return _fast(x, "spec") or spec_naive
