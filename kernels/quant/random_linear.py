"""Random quantized linears built straight on a device (benchmarks of the full-size model).

`quantize_random_linear(5120, 17408, 2, 128, "cuda")` draws W ~ N(0, 1/in) a row chunk at a
time, rounds it (min-max on a slightly clipped range, no fitting: this is about bytes and speed,
not quality) and packs it into the kernel layout, never holding more than one chunk in fp32.
"""

from __future__ import annotations

import torch

from volundr.kernels.quant.fit import minmax_quant
from volundr.kernels.quant.pack import pack_scale_zero, to_kernel_layout


@torch.no_grad()
def quantize_random_linear(out_features: int, in_features: int, bits: int, group_size: int,
                           device: torch.device | str = "cuda", seed: int = 0,
                           std: float | None = None, chunk_rows: int = 8192):
    """A `volundr.model.quant_linear.QuantLinear` with random weights, on `device`."""
    from volundr.model.quant_linear import QuantLinear  # the model imports this package

    device = torch.device(device)
    layer = QuantLinear(in_features, out_features, bits, group_size, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    std = in_features ** -0.5 if std is None else std
    for n0 in range(0, out_features, chunk_rows):
        n1 = min(out_features, n0 + chunk_rows)
        w = torch.randn(n1 - n0, in_features, generator=gen, device=device) * std
        q, s, z = minmax_quant(w, bits, group_size, shrink=0.9)
        qa, qb = to_kernel_layout(q, bits, group_size)
        layer.qa[:, n0:n1] = qa
        if bits == 3:
            layer.qb[:, n0:n1] = qb
        layer.sz[:, n0:n1] = pack_scale_zero(s, z)
    return layer
