"""Tutel-compatible collectives: ``from dynamoe import net`` where Tutel users had ``from tutel import net``.
See :mod:`dynamoe.parallel.net`."""
from .parallel.net import *  # noqa: F401,F403
from .parallel.net import __all__  # noqa: F401
