"""Re-sharding expert-parallel checkpoints: ``python -m dynamoe.checkpoint.gather`` (N rank files ->
one) and ``python -m dynamoe.checkpoint.scatter`` (one -> M rank files). See :mod:`.reshard`."""
from .reshard import expert_keys, gather, scatter

__all__ = ["expert_keys", "gather", "scatter"]
