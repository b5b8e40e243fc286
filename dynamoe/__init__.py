"""dynamoe: a fast PyTorch Mixture-of-Experts layer whose sparsity, capacity and layout switch per
call at no cost, with a Tutel-compatible surface: ``from dynamoe import system, moe as tutel_moe, net``
where Tutel scripts had ``from tutel import ...`` (``dynamoe.moe.moe_layer``, ``dynamoe.ops``,
``dynamoe.net``, ``dynamoe.system``)."""
from . import moe, net, ops, parallel, system  # parallel registers expert parallelism with the layer
from .moe import MoEConfig, MoELayer, moe_layer

__version__ = "0.1.0"
__all__ = ["moe", "net", "ops", "parallel", "system", "MoELayer", "MoEConfig", "moe_layer", "generate", "__version__"]


def generate(model_or_path, prompt, **kwargs) -> str:
    """Generate text for ``prompt`` (text, token ids or chat messages) with a checkpoint folder or a loaded
    model; see :func:`dynamoe.engine.generate`. Imported on first call, so ``import dynamoe`` stays light."""
    from .engine.generate import generate as _generate

    return _generate(model_or_path, prompt, **kwargs)


def __getattr__(name):
    # ``dynamoe.models`` (model families, checkpoint loader: ``dynamoe.models.load``) is imported on first use
    if name == "models":
        import importlib

        return importlib.import_module(".models", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
