"""RMSNorm and SwiGLU: naive references (naive.py); Triton kernels are added beside them."""

from volundr.kernels.norm.naive import naive_rms_norm, naive_rms_norm_gated, naive_swiglu

__all__ = ["naive_rms_norm", "naive_rms_norm_gated", "naive_swiglu"]
