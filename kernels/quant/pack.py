"""Bit layouts of mixed 2/3/4-bit weights: the checkpoint format and the kernels' format.

A quantized linear has W [N, K] (N = out_features, K = in_features), a bit width b in {2, 3, 4}
and a group size G (a multiple of 32 dividing K; `group_size_for`). Per group of G consecutive
inputs of one output row there is a scale s and a zero z, and

    W[n, k] ~= (q[n, k] - z[n, k // G]) * s[n, k // G],   q in [0, 2^b - 1].

Checkpoint ("volundr-mixed", what the converter writes):
  X.qweight  uint8 [N, K * b / 8]: row n is a little-endian bit stream of q[n, 0..K-1]; q[n, k]
             occupies stream bits [k*b, (k+1)*b), stream bit j being bit (j % 8) of byte j // 8
             (so every 8 values fill exactly b bytes; K must be a multiple of 8).
  X.scales   bf16 [N, K / G];  X.zeros  bf16 [N, K / G] (zeros are real numbers, not rounded).

Kernels (what `QuantLinear` holds after loading; every load is an aligned 32-bit word and the
words of consecutive output rows are adjacent, so a warp's loads are 128-bit and coalesced):
  qa  int32 [K * pa / 32, N], pa = 4 for b = 4 and 2 for b = 2, 3 (the "A plane", low pa bits).
      Group g owns word rows g*WA .. g*WA + WA - 1 (WA = G * pa / 32). Word row g*WA + r, slot
      i (bits [pa*i, pa*i + pa), i < 32 / pa) holds the low pa bits of q[n, g*G + i*WA + r].
  qb  int32 [K / 32, N] for b = 3 (the 1-bit plane of bit 2), int32 [0, N] otherwise. Group g
      owns rows g*WA/2 .. ; word row g*WA/2 + r' holds at bit 2i + 1 the bit 2 of the value of
      A-word r', slot i, and at bit 2i that of A-word r' + WA/2, slot i.
  sz  int32 [K / G, N]: bits 0-15 the bf16 scale, bits 16-31 the bf16 zero of (n, group).
The slot-major order inside a group makes the inputs of one slot of a group's WA words a
contiguous run of x, so a kernel reads x with vector loads.
"""

from __future__ import annotations

import torch

BITS = (2, 3, 4)


def group_size_for(in_features: int, group_size: int = 128) -> int:
    """Group size actually used for a linear with `in_features` inputs: the largest power of two
    <= group_size that divides in_features (128; min(128, K) = 64 for the tiny model's K = 64).
    Powers of two >= 32 only (the kernels' tiles); raises ValueError when none divides K (such a
    linear stays unquantized)."""
    g = 1 << (min(group_size, in_features).bit_length() - 1)
    while g >= 32 and in_features % g:
        g //= 2
    if g < 32:
        raise ValueError(f"in_features {in_features} has no power-of-two group size >= 32 "
                         f"dividing it")
    return g


def quantizable(in_features: int, group_size: int = 128) -> bool:
    try:
        group_size_for(in_features, group_size)
        return True
    except ValueError:
        return False


def plane_bits(bits: int) -> int:
    """Width pa of the A plane: 4 for 4-bit, 2 for 2- and 3-bit (3 = 2-bit plane + 1-bit)."""
    if bits not in BITS:
        raise ValueError(f"bits must be 2, 3 or 4, not {bits}")
    return 4 if bits == 4 else 2


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 with the same bits (two's complement)."""
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


# ---- checkpoint format ------------------------------------------------------------------------
def pack_bitstream(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q [N, K] integers in [0, 2^bits) -> uint8 [N, K * bits / 8] little-endian bit stream."""
    n, k = q.shape
    if k % 8:
        raise ValueError(f"K = {k} must be a multiple of 8")
    v = q.to(torch.int64).view(n, k // 8, 8) << (bits * torch.arange(8, device=q.device))
    v = v.sum(-1, keepdim=True)  # 8 values = `bits` bytes
    out = (v >> (8 * torch.arange(bits, device=q.device))) & 0xFF
    return out.to(torch.uint8).reshape(n, k * bits // 8)


def unpack_bitstream(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [N, K * bits / 8] -> uint8 [N, K] (inverse of pack_bitstream)."""
    n, nbytes = packed.shape
    if nbytes % bits:
        raise ValueError(f"{nbytes} bytes per row is not a whole number of {bits}-bit octets")
    b = packed.to(torch.int64).view(n, nbytes // bits, bits)
    v = (b << (8 * torch.arange(bits, device=packed.device))).sum(-1, keepdim=True)
    q = (v >> (bits * torch.arange(8, device=packed.device))) & ((1 << bits) - 1)
    return q.to(torch.uint8).reshape(n, nbytes * 8 // bits)


# ---- kernel format ----------------------------------------------------------------------------
def to_kernel_layout(q: torch.Tensor, bits: int, group_size: int):
    """q [N, K] (uint8 values) -> (qa, qb) int32 planes of the kernel layout (module docstring)."""
    n, k = q.shape
    g = group_size
    pa = plane_bits(bits)
    wa, slots = g * pa // 32, 32 // pa
    q = q.to(torch.int64).view(n, k // g, slots, wa)  # [n, group, slot i, word r]
    shifts = (pa * torch.arange(slots, device=q.device)).view(1, 1, slots, 1)
    words = ((q & ((1 << pa) - 1)) << shifts).sum(2)  # [n, group, wa]
    qa = _to_int32(words).permute(1, 2, 0).reshape(k // g * wa, n).contiguous()
    if bits != 3:
        return qa, torch.zeros(0, n, dtype=torch.int32, device=q.device)
    hb = (q >> 2) & 1  # [n, group, 16, wa]
    h = wa // 2
    shifts = (2 * torch.arange(slots, device=q.device)).view(1, 1, slots, 1)
    words = ((hb[..., :h] << (shifts + 1)) | (hb[..., h:] << shifts)).sum(2)  # [n, group, h]
    qb = _to_int32(words).permute(1, 2, 0).reshape(k // g * h, n).contiguous()
    return qa, qb


def from_kernel_layout(qa: torch.Tensor, qb: torch.Tensor, bits: int, group_size: int,
                       in_features: int) -> torch.Tensor:
    """(qa, qb) -> q [N, K] uint8 (inverse of to_kernel_layout)."""
    n, k, g = qa.shape[1], in_features, group_size
    pa = plane_bits(bits)
    wa, slots = g * pa // 32, 32 // pa
    words = qa.to(torch.int64).view(k // g, wa, n).permute(2, 0, 1)  # [n, group, wa]
    shifts = (pa * torch.arange(slots, device=qa.device)).view(1, 1, slots, 1)
    q = (words.unsqueeze(2) >> shifts) & ((1 << pa) - 1)  # [n, group, slot, wa]
    if bits == 3:
        h = wa // 2
        hw = qb.to(torch.int64).view(k // g, h, n).permute(2, 0, 1).unsqueeze(2)
        s2 = (2 * torch.arange(slots, device=qa.device)).view(1, 1, slots, 1)
        hi = torch.cat([(hw >> (s2 + 1)) & 1, (hw >> s2) & 1], dim=3)  # [n, group, slot, wa]
        q = q | (hi << 2)
    return q.reshape(n, k).to(torch.uint8)


def pack_scale_zero(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """scales, zeros [N, K/G] (bf16) -> sz int32 [K/G, N]: scale bits low, zero bits high."""
    s = scales.to(torch.bfloat16).contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    z = zeros.to(torch.bfloat16).contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    return _to_int32(s | (z << 16)).t().contiguous()


def unpack_scale_zero(sz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sz int32 [K/G, N] -> (scales, zeros) bf16 [N, K/G]."""
    v = sz.t().to(torch.int64) & 0xFFFFFFFF
    lo = v & 0xFFFF
    hi = v >> 16
    as_bf16 = lambda u: torch.where(u >= 2**15, u - 2**16, u).to(torch.int16).view(torch.bfloat16)
    return as_bf16(lo).contiguous(), as_bf16(hi).contiguous()
