"""Mixed 2/3/4-bit weights: formats (pack.py), error-minimising fit (fit.py), naive reference
(naive.py), Triton GEMV/GEMM (gemv.py, gemm.py), the CUDA entry point (engine.py) and random
quantized linears for benchmarks (random_linear.py)."""


def __getattr__(name: str):
    # lazy: random_linear imports volundr.model, which imports this package's naive/pack
    if name == "quantize_random_linear":
        from volundr.kernels.quant.random_linear import quantize_random_linear

        return quantize_random_linear
    raise AttributeError(name)
