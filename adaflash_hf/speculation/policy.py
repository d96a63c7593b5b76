"""Kept for imports: the verify-length policy names live in :mod:`.length.names`."""

from .length.names import *  # noqa: F401,F403
from .length.names import __all__  # noqa: F401
