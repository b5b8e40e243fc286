"""Distribution of the MoE layer over torch.distributed: collectives (``net``) and expert parallelism
(``expert_parallel``), which registers itself with the layer's exchange extension point."""
from ..moe.exchange import register_distributed_exchange
from . import expert_parallel, net
from .expert_parallel import AllToAllExchange

register_distributed_exchange(AllToAllExchange)

__all__ = ["net", "expert_parallel", "AllToAllExchange"]
