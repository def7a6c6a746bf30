"""The loader's error, in a module of its own so that what only fetches weights (``slipstream
download``, :mod:`.fetch`) imports no torch."""
from __future__ import annotations


class ModelLoadError(ValueError):
    """The model could not be loaded; the message names the file and the problem."""
