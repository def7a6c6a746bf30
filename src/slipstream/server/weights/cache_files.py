"""The model cache's own files: where its metadata lives and how it is read back."""
from __future__ import annotations

import json
from pathlib import Path

META_DIR = ".slipstream"
HF_DIR = "hf"  # huggingface_hub's cache_dir for Hub models, under the cache root


def read_text(path: Path) -> str | None:
    """The text of ``path``, or None when it is gone (released or removed meanwhile)."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def parse_json(content: str) -> dict:
    """``content`` as a JSON object; ``{}`` for anything else."""
    try:
        value = json.loads(content)
    except ValueError:  # a lock being written: treat as a live holder we know nothing about
        return {}
    return value if isinstance(value, dict) else {}


def relative_path(root: Path, path: str) -> str:
    """``path`` relative to the cache ``root`` when it is under it (a cache copied, mounted
    elsewhere or named relatively still resolves), else as given."""
    try:
        return str(Path(path).relative_to(root.resolve()))
    except ValueError:
        return path
