"""A speculative step's small device work between its graph replays: naive references
(naive.py) and Triton kernels (engine.py)."""
