"""The Volundr network in PyTorch; kernels are chosen per device in volundr.ops."""

from volundr.model.batch import ForwardBatch
from volundr.model.volundr import VolundrForCausalLM

__all__ = ["ForwardBatch", "VolundrForCausalLM"]
