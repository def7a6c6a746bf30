"""Offline mode as huggingface_hub decides it from the environment, and how to leave it."""
from __future__ import annotations

import os

# huggingface_hub's own rule: HF_HUB_OFFLINE when set (an image's HF_HUB_OFFLINE=0 overrides its
# TRANSFORMERS_OFFLINE=1), else TRANSFORMERS_OFFLINE
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def _is_true(value: str | None) -> bool:
    return value is not None and value.upper() in ("1", "ON", "YES", "TRUE")  # huggingface_hub's test, unstripped


def offline_var() -> str | None:
    """The environment variable that turns offline mode on, if one does: ``HF_HUB_OFFLINE``
    when set decides (``0`` keeps a process online whatever ``TRANSFORMERS_OFFLINE`` says), as
    in huggingface_hub."""
    name = next((n for n in _OFFLINE_VARS if os.environ.get(n)), None)
    return name if name is not None and _is_true(os.environ[name]) else None


def offline_env() -> bool:
    """Whether the environment puts this process in offline mode (:func:`offline_var`)."""
    return offline_var() is not None


def offline_hint(flag: bool = False) -> str:
    """How to go online again, naming every cause: ``--offline`` (``flag``) and the variable
    that made this process offline: ``unset`` it where nothing else turns offline mode on, else
    ``set HF_HUB_OFFLINE=0`` (which decides over ``TRANSFORMERS_OFFLINE``)."""
    steps = ["drop --offline"] if flag else []
    var = offline_var()
    if var is not None and all(n == var or not _is_true(os.environ.get(n)) for n in _OFFLINE_VARS):
        steps.append(f"unset {var}")
    elif var is not None:
        steps.append("set HF_HUB_OFFLINE=0")
    return " and ".join(steps) or "drop --offline"
