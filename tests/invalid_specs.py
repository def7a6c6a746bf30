"""The bad InferenceServices of tests/operator/invalid/: each file's header says which layer
refuses it (``# rejected by: schema | cel | operator``) and what the message mentions."""
from __future__ import annotations

from pathlib import Path

INVALID = sorted((Path(__file__).parent / "operator" / "invalid").glob("*.yaml"))


def header(path: Path, key: str) -> str:
    """The value of the ``# KEY: value`` line of ``path``; KeyError without one."""
    for line in path.read_text().splitlines():
        if line.startswith(f"# {key}:"):
            return line.split(":", 1)[1].strip()
    raise KeyError(key)
