"""Distribution of the MoE layer over torch.distributed (collectives in ``net``)."""
from . import net

__all__ = ["net"]
