"""dynamoe: a fast PyTorch Mixture-of-Experts layer whose sparsity, capacity and layout switch per
call at no cost, with a Tutel-compatible surface (``dynamoe.moe.moe_layer``, ``dynamoe.ops``)."""
from . import moe, ops
from .moe import MoEConfig, MoELayer, moe_layer

__version__ = "0.1.0"
__all__ = ["moe", "ops", "MoELayer", "MoEConfig", "moe_layer", "__version__"]
