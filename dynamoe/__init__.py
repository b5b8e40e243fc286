"""dynamoe: a fast PyTorch Mixture-of-Experts layer whose sparsity, capacity and layout switch per
call at no cost, with a Tutel-compatible surface (``dynamoe.moe.moe_layer``, ``dynamoe.ops``,
``dynamoe.net``)."""
from . import moe, ops, parallel  # parallel registers expert parallelism with the layer
from .moe import MoEConfig, MoELayer, moe_layer

__version__ = "0.1.0"
__all__ = ["moe", "ops", "parallel", "MoELayer", "MoEConfig", "moe_layer", "__version__"]
