"""Kept for imports: the round cost model lives in :mod:`.length.cost`."""

from .length.cost import *  # noqa: F401,F403
from .length.cost import __all__  # noqa: F401
