"""Which files of a model are its weights: the folder or the one GGUF file in it, the error for a
folder of several GGUF files, and their size."""
from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Iterable

from .errors import ModelSourceError


def files_bytes(files: Iterable[Path]) -> int:
    """Bytes of ``files`` (symlinks followed, as into huggingface_hub's blobs); missing ones count 0."""
    total = 0
    for f in files:
        with contextlib.suppress(OSError):
            total += Path(f).stat().st_size
    return total


_SHARD = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def several_ggufs(what: str, ggufs: list[str], example: str) -> ModelSourceError:
    """The error for a model that holds several GGUF files and names none of them (reason
    ``InvalidURI``): ``what`` leads the message (``"model 'x': org/name holds"``), ``example`` shows a
    URI that names one. The one wording for every source (hf, s3, local folders).
    Shards of one split model (``NAME-00001-of-00003.gguf``) get their own message: not supported."""
    if all(_SHARD.search(g) for g in ggufs) and len({_SHARD.sub("", g) for g in ggufs}) == 1:
        return ModelSourceError(f"{what} a GGUF model split into {len(ggufs)} shards ({', '.join(ggufs[:3])}"
                                f"{', ...' if len(ggufs) > 3 else ''}), which is not supported yet; merge them into one "
                                "file (llama.cpp: llama-gguf-split --merge) and serve that, or choose a quantization "
                                "stored as one file", reason="InvalidURI")
    return ModelSourceError(f"{what} {len(ggufs)} GGUF files ({', '.join(ggufs[:6])}{', ...' if len(ggufs) > 6 else ''}); "
                            f"choose one, e.g. {example}", reason="InvalidURI")


def weights_path(folder: Path, files: list[str], *, model: str | None = None, example: str | None = None) -> Path:
    """What the loader loads from a ``folder`` holding ``files`` (relative paths): the folder, or the
    GGUF file when that is the only weight file. Pure: it decides from the names, so a source can
    call it on a listing before downloading anything. ``model`` and ``example`` word the error
    (default: the folder, and a file-selector hint).

    Raises:
        ModelSourceError: several GGUF files and no safetensors (reason ``InvalidURI``).
    """
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if any(f.endswith(".safetensors") for f in files) or not ggufs:
        return folder
    if len(ggufs) > 1:
        raise several_ggufs(f"model {model!r} holds" if model else f"{folder}:", ggufs, example or
                            "a file selector (hf://ORG/NAME:*Q4_K_M.gguf) or an s3:// URI naming the one object")
    return folder / ggufs[0]
