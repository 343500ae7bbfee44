"""The checkpoint's tensor names and shapes: the one table the model, converter and loader share.

Names follow Hugging Face conventions (`model.layers.{i}.…`). A checkpoint holds exactly these
tensors (plus, for quantized linears, `X.qweight/X.scales/X.zeros` instead of `X.weight`).
"""

from __future__ import annotations

from dataclasses import dataclass

from volundr.config import VolundrConfig

# Parts that are lookup tables, not compute: they stay in host memory whatever the device.
HOST_PARTS = ("embedding", "engram")


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    part: str  # compute | embedding | engram | mtp | vision: where it lives and how it is counted
    linear: bool = False  # a [out, in] matmul weight that the quantizer may pack


def _attention(prefix: str, c: VolundrConfig, part: str) -> dict[str, TensorSpec]:
    d, hd = c.hidden_size, c.head_dim
    h, kvh = c.num_attention_heads, c.num_key_value_heads
    return {
        f"{prefix}.q_proj.weight": TensorSpec((h * hd, d), part, True),
        f"{prefix}.k_proj.weight": TensorSpec((kvh * hd, d), part, True),
        f"{prefix}.v_proj.weight": TensorSpec((kvh * hd, d), part, True),
        f"{prefix}.o_proj.weight": TensorSpec((d, h * hd), part, True),
    }


def _mlp(prefix: str, c: VolundrConfig, part: str) -> dict[str, TensorSpec]:
    d, i = c.hidden_size, c.intermediate_size
    return {
        f"{prefix}.gate_proj.weight": TensorSpec((i, d), part, True),
        f"{prefix}.up_proj.weight": TensorSpec((i, d), part, True),
        f"{prefix}.down_proj.weight": TensorSpec((d, i), part, True),
    }


def _kda(prefix: str, c: VolundrConfig) -> dict[str, TensorSpec]:
    d, k = c.hidden_size, c.kda
    hk = k.num_heads * k.head_dim
    r = k.rank
    s = {
        f"{prefix}.q_proj.weight": TensorSpec((hk, d), "compute", True),
        f"{prefix}.k_proj.weight": TensorSpec((hk, d), "compute", True),
        f"{prefix}.v_proj.weight": TensorSpec((hk, d), "compute", True),
        # depthwise causal conv kernels, [channels, conv_size]; the newest input is the last tap
        f"{prefix}.q_conv1d.weight": TensorSpec((hk, k.conv_size), "compute"),
        f"{prefix}.k_conv1d.weight": TensorSpec((hk, k.conv_size), "compute"),
        f"{prefix}.v_conv1d.weight": TensorSpec((hk, k.conv_size), "compute"),
        # decay gate g = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias), per head and channel
        f"{prefix}.f_a_proj.weight": TensorSpec((r, d), "compute", True),
        f"{prefix}.f_b_proj.weight": TensorSpec((hk, r), "compute", True),
        f"{prefix}.A_log": TensorSpec((k.num_heads,), "compute"),
        f"{prefix}.dt_bias": TensorSpec((hk,), "compute"),
        f"{prefix}.b_proj.weight": TensorSpec((k.num_heads, d), "compute", True),
        # output gate sigmoid(g_b(g_a(x))) and the per-head RMSNorm weight
        f"{prefix}.g_a_proj.weight": TensorSpec((r, d), "compute", True),
        f"{prefix}.g_b_proj.weight": TensorSpec((hk, r), "compute", True),
        f"{prefix}.o_norm.weight": TensorSpec((k.head_dim,), "compute"),
        f"{prefix}.o_proj.weight": TensorSpec((d, hk), "compute", True),
    }
    return s


def _engram(prefix: str, c: VolundrConfig) -> dict[str, TensorSpec]:
    e, d = c.engram, c.hidden_size
    s = {f"{prefix}.tables.{j}": TensorSpec((rows, e.dim), "engram")
         for j, rows in enumerate(e.table_sizes)}
    s.update({
        f"{prefix}.k_proj.weight": TensorSpec((d, e.num_tables * e.dim), "compute", True),
        f"{prefix}.v_proj.weight": TensorSpec((d, e.num_tables * e.dim), "compute", True),
        f"{prefix}.h_norm.weight": TensorSpec((d,), "compute"),
        f"{prefix}.k_norm.weight": TensorSpec((d,), "compute"),
        f"{prefix}.u_norm.weight": TensorSpec((d,), "compute"),
        f"{prefix}.conv1d.weight": TensorSpec((d, e.conv_size), "compute"),
    })
    return s


def _decoder_layer(prefix: str, c: VolundrConfig, attention: bool, part: str):
    d = c.hidden_size
    s = {
        f"{prefix}.input_layernorm.weight": TensorSpec((d,), part),
        f"{prefix}.post_attention_layernorm.weight": TensorSpec((d,), part),
    }
    s.update(_attention(f"{prefix}.self_attn", c, part) if attention else _kda(f"{prefix}.kda", c))
    s.update(_mlp(f"{prefix}.mlp", c, part))
    return s


def expected_tensors(c: VolundrConfig) -> dict[str, TensorSpec]:
    """Every tensor a bf16 checkpoint of config `c` holds, with its shape and part."""
    d, v = c.hidden_size, c.vocab_size
    s: dict[str, TensorSpec] = {"model.embed_tokens.weight": TensorSpec((v, d), "embedding")}
    for i in range(c.num_hidden_layers):
        s.update(_decoder_layer(f"model.layers.{i}", c, c.is_attention(i), "compute"))
        if i in c.engram.layers:
            s.update(_engram(f"model.layers.{i}.engram", c))
    s["model.norm.weight"] = TensorSpec((d,), "compute")
    if not c.tie_word_embeddings:
        s["lm_head.weight"] = TensorSpec((v, d), "compute", True)
    if c.mtp.num_layers:
        s["mtp.eh_proj.weight"] = TensorSpec((d, 2 * d), "mtp", True)
        s["mtp.enorm.weight"] = TensorSpec((d,), "mtp")
        s["mtp.hnorm.weight"] = TensorSpec((d,), "mtp")
        s.update(_decoder_layer("mtp.layer", c, True, "mtp"))
    return s


def count_parameters(c: VolundrConfig) -> dict[str, int]:
    """Parameters per part (compute, embedding, engram, mtp, vision)."""
    out: dict[str, int] = {}
    for spec in expected_tensors(c).values():
        n = 1
        for x in spec.shape:
            n *= x
        out[spec.part] = out.get(spec.part, 0) + n
    return out


def host_tensor_names(c: VolundrConfig) -> list[str]:
    """The checkpoint tensors that live in host memory (token embedding, Engram tables)."""
    return [n for n, spec in expected_tensors(c).items() if spec.part in HOST_PARTS]
