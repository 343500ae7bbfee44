"""Volundr for causal LM: 72 (or a tiny number of) hybrid layers, 1 full-attention layer in 4.

Every layer: h = h + Mixer(RMSNorm(h)); h = h + MLP(RMSNorm(h)); Engram layers first do
h = h + Engram(h, ids). Then the final RMSNorm and lm_head. The MTP block predicts token i + 2
from the last hidden state of token i and the embedding of token i + 1 (a draft source).

The token embedding and the Engram tables are host-resident lookup tables (not parameters), so
they never count against the GPU: on CUDA they are pinned and the GPU reads the rows a step needs
in place; elsewhere (and for tensor-parallel ranks, which share unpinned tables) the rows are
gathered on the host and copied.
"""

from __future__ import annotations

import torch
from torch import nn

from volundr import ops
from volundr.config import VolundrConfig
from volundr.model.attention import Attention
from volundr.model.batch import ForwardBatch
from volundr.model.engram import Engram, pin, pinned_tables
from volundr.model.kda import KDA
from volundr.model.layers import MLP, NextNorm, Normed, PendingOut, PreNorm, RMSNorm
from volundr.model.parallel import TP, ParallelLMHead


class DecoderLayer(nn.Module):
    def __init__(self, cfg: VolundrConfig, attention: bool, engram: bool, tp: TP = TP()):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if attention:
            self.self_attn = Attention(cfg, tp)
        else:
            self.kda = KDA(cfg, tp)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp)
        self.engram = Engram(cfg) if engram else None  # replicated on every rank

    def forward(self, h: torch.Tensor, b: ForwardBatch, layer_idx: int | None = None,
                delta: torch.Tensor | Normed | None = None, next_norm: RMSNorm | None = None):
        """The residual stream is h + delta (delta: the previous layer's MLP output, or None):
        the add happens inside this layer's first norm, not as a separate kernel, and each
        norm is handed on as a PreNorm, which the projection reading it may fold into its own
        matmul (the mixed-bit GEMV at batch 1 with VOLUNDR_NORM_FOLD=1). Where the previous
        layer's down projection folded the add and this layer's input norm into its epilogue
        (the mixed-bit GEMV at batch 1, engine.RESIDUAL_NORM_FOLD), delta is that Normed,
        which holds the stream; likewise the mixer's output projection for the post-attention
        norm, and the MLP's for `next_norm` (the next layer's input norm; None: not folded).
        Returns the (h, delta) of the next layer."""
        x = None
        if isinstance(delta, Normed):  # the stream is its residual_out; the norm is ours
            h, x, delta = delta.residual_out, (delta if self.engram is None else None), None
        if x is None and delta is not None and self.engram is None:
            x = PreNorm(delta, h, self.input_layernorm)  # h + delta, and its norm
        elif x is None:
            if delta is not None:
                h = h + delta
            if self.engram is not None:
                h = self.engram(h, b, b.engram_embeds[layer_idx])
            x = self.input_layernorm(h)
        mixer = self.self_attn if hasattr(self, "self_attn") else self.kda
        src = h if isinstance(x, torch.Tensor) else x  # where the stream will be (NextNorm)
        # its first projection takes x: it may fold the norm into its matmul; its output
        # projection may wait for the MLP's two GEMVs to run with them in one launch
        chain = next_norm is not None and self.mlp.swiglu_in_down and _chains(h)
        out = mixer(x, b, post=NextNorm(src, self.post_attention_layernorm, defer=chain))
        if isinstance(out, PendingOut):
            r = self.mlp.forward_chained(out, next_norm)
            if r is not None:
                return r
            out = out.value()
        if not isinstance(x, torch.Tensor):
            h = x.residual_out
        x = out if isinstance(out, Normed) else PreNorm(out, h, self.post_attention_layernorm)
        delta = self.mlp(x, post=None if next_norm is None else NextNorm(x, next_norm))
        return x.residual_out, delta


def _chains(like: torch.Tensor) -> bool:
    """Whether the mixed-bit GEMVs may chain at this call: CUDA, with the kernels'
    engine.GEMV_CHAIN on (read at call time: the decode graphs capture the choice)."""
    fast = ops._fast(like, "quant")
    return fast is not None and fast.GEMV_CHAIN


def run_layers(layers: nn.ModuleList, h: torch.Tensor, b: ForwardBatch) -> torch.Tensor:
    """The residual stream after `layers` (DecoderLayers) from h [T, d]."""
    delta = None
    for i, layer in enumerate(layers):
        # the next layer's input norm may go into this layer's down projection (not before an
        # Engram layer: it adds to the stream before its norm)
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        norm = nxt.input_layernorm if nxt is not None and nxt.engram is None else None
        h, delta = layer(h, b, i, delta, norm)
    return h + delta


class MTPBlock(nn.Module):
    """h' = W_eh [RMSNorm(Emb(t_{i+1})); RMSNorm(h_i)], then one full-attention layer."""

    def __init__(self, cfg: VolundrConfig, tp: TP = TP()):
        super().__init__()
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layer = DecoderLayer(cfg, attention=True, engram=False, tp=tp)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, b: ForwardBatch):
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        h, delta = self.layer(x, b)
        return h + delta


class VolundrModel(nn.Module):
    def __init__(self, cfg: VolundrConfig, tp: TP = TP()):
        super().__init__()
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, cfg.is_attention(i), i in cfg.engram.layers, tp)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class VolundrForCausalLM(nn.Module):
    def __init__(self, cfg: VolundrConfig, tp: TP = TP()):
        """`tp`: this process's tensor-parallel rank (volundr.model.parallel); the weights then
        take `shard_state_dict(cfg, sd, tp.rank, tp.size)`."""
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.model = VolundrModel(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)  # vocab-parallel
        self.mtp = MTPBlock(cfg, tp) if cfg.mtp.num_layers else None
        self.embed_tokens: torch.Tensor | None = None  # [vocab, hidden] on the host
        self._lookups_on_gpu = False

    # ---- weights ------------------------------------------------------------------------
    def load_weights(self, state_dict: dict[str, torch.Tensor], device: torch.device,
                     dtype: torch.dtype) -> None:
        """Host tables go to host memory, page-locked on CUDA (`engram.pin`: tables in shared
        memory, which tensor-parallel ranks share, are locked in place); the rest becomes the
        parameters, assigned (not copied) so a model built on `meta` never holds two copies.
        Tensors already of the right dtype stay as they are (e.g. fp32 A_log is cast)."""
        sd = dict(state_dict)
        locked = device.type == "cuda"

        def host(t: torch.Tensor) -> torch.Tensor:
            t = t.to("cpu")
            return pin(t) if locked else t

        self.embed_tokens = host(sd.pop("model.embed_tokens.weight"))
        self._lookups_on_gpu = locked
        for i in self.cfg.engram.layers:
            eng = self.model.layers[i].engram
            tables = [sd.pop(f"model.layers.{i}.engram.tables.{j}")
                      for j in range(self.cfg.engram.num_tables)]
            if locked:  # one pinned buffer per layer, which the GPU lookup kernel reads in place
                eng.tables, eng.meta = pinned_tables(tables, self.cfg.engram, device)
            else:
                eng.tables = [host(t) for t in tables]
            del tables
        if self.cfg.tie_word_embeddings:  # (a TP shard already carries its lm_head rows)
            sd.setdefault("lm_head.weight", self.embed_tokens)
        own = dict(self.named_parameters())
        for name, t in sd.items():
            if name in own and t.is_floating_point():
                sd[name] = t.to(device=device, dtype=dtype)
        self.load_state_dict(sd, strict=True, assign=True)
        sd.clear()  # the fused projections below must not leave the separate tensors alive
        for m in [m for m in self.modules() if hasattr(m, "after_load")]:
            m.after_load()

    # ---- forward ------------------------------------------------------------------------
    @property
    def lookups_on_gpu(self) -> bool:
        """The host tables are pinned: the GPU reads them in place, so the runner hands the
        lookups ids on the GPU (and the decode graph captures them). Set by load_weights (an
        is_pinned() query per step costs a CUDA driver call)."""
        return self._lookups_on_gpu

    def embed(self, ids: torch.Tensor, device: torch.device, dtype: torch.dtype):
        """Token embeddings, ids [T] -> [T, d] on `device`."""
        return ops.embedding_lookup(ids.long().unsqueeze(1), self.embed_tokens, device, dtype)

    def gather_inputs(self, b: ForwardBatch) -> None:
        """The lookups of a step (embedding rows, Engram rows) into b.inputs_embeds /
        b.engram_embeds on the device; image positions take b.embeds."""
        # Norm weights are never quantized: they carry the compute dtype and device.
        dtype, device = self.model.norm.weight.dtype, self.model.norm.weight.device
        h = ops.embedding_lookup(b.ngram_ids, self.embed_tokens, device, dtype)
        if b.embed_positions is not None:
            h[b.embed_positions] = b.embeds.to(h.dtype)
        b.inputs_embeds = h
        b.engram_embeds = {i: self.model.layers[i].engram.lookup(b.ngram_ids, device, dtype)
                           for i in self.cfg.engram.layers}

    def forward(self, b: ForwardBatch) -> torch.Tensor:
        """Hidden states of every token before the final norm, [T, d]. With b.ngram_ids on the
        GPU this is device work only (the decode step's CUDA graph captures all of it)."""
        self.gather_inputs(b)
        return run_layers(self.model.layers, b.inputs_embeds, b)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Final norm + lm_head of selected hidden states [M, d] -> fp32 logits [M, vocab].
        With tensor parallelism every rank must call it; ranks other than 0 get None."""
        logits = self.lm_head(self.model.norm(hidden))
        return None if logits is None else logits.float()

    def mtp_logits(self, hidden: torch.Tensor, next_ids_host: torch.Tensor, b: ForwardBatch):
        """MTP draft logits for token i + 2 from hidden of i [T, d] and ids of i + 1 [T]."""
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP block")
        e = self.embed(next_ids_host, hidden.device, hidden.dtype)
        return self.compute_logits(self.mtp(hidden, e, b))
