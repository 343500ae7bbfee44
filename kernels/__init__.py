"""GPU kernels (Triton) for Volundr, each op with a naive PyTorch reference in `<op>/naive.py`."""
