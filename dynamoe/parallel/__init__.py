"""Distribution of the MoE layer over torch.distributed: collectives (``net``) and expert parallelism
(``expert_parallel``), which registers itself with the layer's exchange extension point."""
from ..moe.exchange import register_distributed_exchange
from . import expert_parallel, net, zero
from .expert_parallel import AllToAllExchange
from .zero import ZeroOptimizer, data_parallel, is_expert_parameter

register_distributed_exchange(AllToAllExchange)

__all__ = ["net", "expert_parallel", "zero", "AllToAllExchange", "ZeroOptimizer", "data_parallel", "is_expert_parameter"]
