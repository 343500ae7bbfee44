"""Logits-level quality of a quantized model: the model's prefill logits with dequantized weights
against the same model in full precision, on the CPU (or any device).

Used by `python -m volundr.converter quantize` for its report (each uniform bit width and the
mixed result) and by tests/test_quant.py. `mid_config()` is the mid-size random model of those
measurements (hidden 512, 4 layers, the 32B's head size and the full layer pattern).
"""

from __future__ import annotations

import random

import torch

from volundr.config import EngramConfig, KDAConfig, MTPConfig, VolundrConfig


def mid_config(vocab_size: int = 4096, hidden_size: int = 512, num_layers: int = 4,
               intermediate_size: int = 1536, seed: int = 0) -> VolundrConfig:
    """A mid-size Volundr (default hidden 512, 4 layers: 3 KDA + 1 attention, Engram in layer
    1, hidden / 128 heads of 128 with 2 KV heads, intermediate 1536, MTP)."""
    from volundr.converter.presets import hash_seeds

    heads = max(2, hidden_size // 128)
    return VolundrConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        intermediate_size=intermediate_size, num_attention_heads=heads,
        num_key_value_heads=2, head_dim=128,
        kda=KDAConfig(num_heads=heads, head_dim=128, conv_size=4, low_rank_dim=128),
        engram=EngramConfig(layers=(1,), ngram_orders=(2, 3), heads_per_order=4,
                            rows_per_head=1009, dim=64, conv_size=4, pad_id=0,
                            hash_seeds=hash_seeds(8, seed)),
        mtp=MTPConfig(num_layers=1), max_position_embeddings=4096, eos_token_id=(2, 0))


def eval_prompt(cfg: VolundrConfig, length: int = 48, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, cfg.vocab_size) for _ in range(length)]


@torch.inference_mode()
def prefill_logits(cfg: VolundrConfig, sd: dict[str, torch.Tensor], ids: list[int],
                   device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp32 logits [T, vocab] of every prompt position, one prefill through the engine's model
    (a quantized cfg goes through QuantLinear, a plain one through nn.Linear)."""
    from volundr.engine import EngineConfig, LLMEngine
    from volundr.sampling_params import SamplingParams
    from volundr.scheduler import ScheduledSeq
    from volundr.sequence import Sequence

    blocks = (len(ids) + 15) // 16 + 1
    ecfg = EngineConfig(device=device, dtype=dtype, max_num_seqs=1,
                        max_num_batched_tokens=max(len(ids), 16), max_model_len=blocks * 16,
                        num_kv_blocks=blocks, cuda_graphs=False)
    engine = LLMEngine(cfg, sd, ecfg, tuple(cfg.eos_token_id))
    runner = engine.runner
    seq = Sequence("eval", list(ids), SamplingParams())
    seq.slot = engine.slots.allocate()
    engine.block_manager.grow(seq, len(ids))
    for t in runner.states:
        t[seq.slot] = 0
    b = runner.prepare([ScheduledSeq(seq, len(ids))])
    return runner.model.compute_logits(runner.model(b)).float().cpu()


def logits_error(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    """rel_l2 = ||got - ref|| / ||ref||, top1 = agreement of argmax, kl = mean KL(ref || got)."""
    ref, got = ref.double(), got.double()
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    return {
        "rel_l2": ((got - ref).norm() / ref.norm()).item(),
        "top1": (ref.argmax(-1) == got.argmax(-1)).double().mean().item(),
        "kl": (lp.exp() * (lp - lq)).sum(-1).mean().item(),
    }


def with_weights(sd: dict[str, torch.Tensor], weights: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A copy of `sd` with X.weight replaced by `weights[X]` (dequantized), all floats in dtype."""
    out = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}
    for module, w in weights.items():
        out[f"{module}.weight"] = w.to(dtype)
    return out
