"""What `volundr.ops` calls for KDA on CUDA tensors (same arguments as `ops.kda_mixer`,
`ops.causal_conv` and `ops.kda_decode`).

kda_mixer: the state pool is read and written in place at `slot_ids`. Steps where every sequence
has at most `DECODE_MAX_LEN` new tokens (decode, speculative verification) take the one-launch
token-by-token kernel; anything longer takes the chunked kernels over the whole packed batch.

kda_decode: a decode step (one token per sequence) of the whole mixer, conv included: what
`causal_conv` followed by `kda_mixer` computes for that step, in one launch (decode.py), taken
where `decode_fits` (up to `DECODE_FUSED_MAX_T` sequences); `ops.kda_decode` runs the two
above that.
"""

from __future__ import annotations

import os

import torch

from volundr.kernels.kda.chunk import chunk_kda
from volundr.kernels.kda.conv import causal_conv1d
from volundr.kernels.kda.decode import kda_decode  # noqa: F401  (re-exported for ops)
from volundr.kernels.kda.fused_recurrent import fused_recurrent_kda
from volundr.kernels.kda.rows import kda_rows  # noqa: F401  (re-exported for ops)

# Up to this many tokens per sequence the recurrent kernel (one pass over the state per token)
# beats two chunked launches plus their intermediates.
DECODE_MAX_LEN = 16
# Up to this many sequences a decode step takes the one-launch kernel (conv fused in): it saves
# a launch and the round trip of the conv outputs, which is what a small batch costs; at larger
# batches, where the state traffic dominates, it lost to the two kernels on the H200 (decode.py's
# CONFIG: equal at batch 16, 4% slower at 64).
DECODE_FUSED_MAX_T = 16
# KDA's low-rank gate projections f_b / g_b (rank -> H K each; 4-bit, one quant group per row)
# computed inside the decode kernel from their kernel-layout words (decode.py `low_rank`), so
# the grouped GEMV's launch (54 per Volundr-32B token, ~2.8 us each in the graph) goes. Right
# on the H200 but no faster there (run 30: the KDA kernel 5.8 -> 8.0 us per call, eager 98 us
# per token less, graph 6.276 -> 6.267 ms, within run-to-run noise; run 29's first form, the
# gate math before the state's loads, 6.264 -> 6.499 ms). Opt-in: VOLUNDR_KDA_LOW_RANK_FOLD=1.
LOW_RANK_FOLD = os.environ.get("VOLUNDR_KDA_LOW_RANK_FOLD", "0") == "1"
# A speculative check's conv + KDA and its commit's each in one launch (rows.py): 54 x 2
# launches fewer a Volundr-32B step. H100 run 136, one layer graph-replayed, 1 sequence x 3
# rows: check 17.7 -> 11.0 us, commit 16.9 -> 10.7 us (16 x 3: 74.8 -> 44.2, 80.5 -> 46.2);
# runs 137-138, a perfect MTP head at k = 2: 290.3 -> 306.4 tok/s. VOLUNDR_KDA_ROWS=0 goes back.
ROWS_FUSED = os.environ.get("VOLUNDR_KDA_ROWS", "1") == "1"


def _max_len(cu_list: list[int], T: int) -> int:
    if T == len(cu_list) - 1:          # as many tokens as sequences: one each (or the cheap case)
        return 1
    return max(b - a for a, b in zip(cu_list[:-1], cu_list[1:]))


def kda_mixer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor,
              cu_seqlens: torch.Tensor, cu_list: list[int], scale: float,
              A_log: torch.Tensor | None = None,
              dt_bias: torch.Tensor | None = None, update_state: bool = True) -> torch.Tensor:
    """KDA over packed sequences. q, k [T, H, K] (pre-L2-norm, any token stride); v [T, H, V];
    g [T, H, K] log decay and beta [T, H] after sigmoid, or, with A_log [H] (and dt_bias
    [H * K]), the raw logits of both: the kernels then apply the gate
    g = -exp(A_log) * softplus(g + dt_bias) and the sigmoid (no separate launches for them);
    state [slots, H, K, V] fp32, rows slot_ids [N] updated in place; cu_seqlens [N + 1] int32
    (cu_list: the same on the host); update_state False: read, not written. Returns
    o [T, H, V] in v.dtype."""
    args = (q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0))
    raw = A_log is not None
    kw = dict(scale=scale, initial_state=state, cu_seqlens=cu_seqlens, ssm_state_indices=slot_ids,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=raw,
              use_beta_sigmoid_in_kernel=raw, A_log=A_log, dt_bias=dt_bias,
              inplace_final_state=update_state)
    T, N = q.shape[0], len(cu_list) - 1
    if T == N and cu_list == list(range(N + 1)) and update_state:
        # decode: one token per sequence
        o, _ = fused_recurrent_kda(*args, one_token_per_seq=True, **kw)
    elif _max_len(cu_list, T) <= DECODE_MAX_LEN:
        o, _ = fused_recurrent_kda(*args, **kw)
    else:
        if not update_state:
            raise ValueError("a read-only state takes at most DECODE_MAX_LEN tokens a sequence")
        o, _ = chunk_kda(*args, cu_seqlens_cpu=cu_list, **kw)
    return o.squeeze(0)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                slot_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                activation: str | None = "silu", update_state: bool = True,
                max_len: int | None = None) -> torch.Tensor:
    """Depthwise causal conv (+ SiLU) over packed sequences. x [T, C]; weight [C, W];
    conv_state [slots, C, W - 1] updated in place at rows slot_ids [N] (update_state False:
    read only). Returns y [T, C]. Without max_len (a bound on tokens per sequence) T == N
    means one token each (decode): an engine step never holds an empty sequence then."""
    one = x.shape[0] == slot_ids.shape[0] if max_len is None else max_len == 1
    return causal_conv1d(x, weight, conv_state, cu_seqlens, slot_ids, activation,
                         max_seqlen=max_len, one_token_per_seq=one, update_state=update_state)


def decode_fits(T: int, conv_width: int) -> bool:
    """Whether `kda_decode` (the one-launch decode step, decode.py) takes a step of T sequences
    with a conv this wide; otherwise `ops.kda_decode` runs `causal_conv` and `kda_mixer`."""
    return conv_width <= 4 and T <= DECODE_FUSED_MAX_T


def decode_takes_low_rank(T: int, conv_width: int, bits: int, group_size: int,
                          rank: int) -> bool:
    """Whether `kda_decode` computes the gate logits itself from f_b / g_b (LOW_RANK_FOLD on):
    a step it takes (`decode_fits`), 4-bit weights with one quant group per row (group size =
    rank) and rank / 8 words per row a power of two."""
    wa = rank // 8
    return (LOW_RANK_FOLD and decode_fits(T, conv_width) and bits == 4 and group_size == rank
            and rank % 32 == 0 and wa & (wa - 1) == 0)


def rows_fit(L: int, conv_width: int, K: int) -> bool:
    """Whether `kda_rows` takes a check of at most L rows a sequence (or its commit): convs of
    width 2 to 4 (taps in named registers), heads of K <= 256 (the programs hold all K)."""
    return ROWS_FUSED and 2 <= conv_width <= 4 and L <= DECODE_MAX_LEN and K <= 256
