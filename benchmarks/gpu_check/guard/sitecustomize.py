"""Import guard of gpu_check's CPU rehearsal: this Python sees only what the GPU machine will.

Python imports ``sitecustomize`` at start-up from the first ``sys.path`` folder that has one;
gpu_check puts this folder first on ``PYTHONPATH`` with ``SLIPSTREAM_GPU_GUARD`` naming a JSON
config (``env.write_guard``). Site-packages then leaves ``sys.path``: top-level imports resolve
from the standard library and the config's ``dirs``; from site-packages only the config's
``modules`` (those of distributions the GPU machine has), and their metadata likewise. A refused
name is appended to ``refused_log`` and is simply not found, as it would not be there.
"""
import json
import os
import sys
import sysconfig
from importlib.machinery import PathFinder


class _Guard:
    def __init__(self, cfg: dict, hidden: list[str]):
        self.dirs, self.modules, self.dists = cfg["dirs"], set(cfg["modules"]), set(cfg["dists"])
        self.hidden, self.log = hidden, cfg["refused_log"]

    def find_spec(self, name, path=None, target=None):
        if path is not None or name in sys.stdlib_module_names:  # a submodule: its parent was allowed
            return None
        spec = PathFinder.find_spec(name, self.dirs)
        if spec is None and name in self.modules:
            spec = PathFinder.find_spec(name, self.hidden)
        if spec is None and PathFinder.find_spec(name, self.hidden) is not None:
            with open(self.log, "a") as f:
                f.write(name + "\n")
        return spec  # None: the path finder over what is left of sys.path decides (stdlib)

    def find_distributions(self, context=None):
        from importlib.metadata import DistributionFinder, MetadataPathFinder
        context = context or DistributionFinder.Context()
        name = getattr(context, "name", None)
        norm = None if name is None else name.replace("_", "-").replace(".", "-").lower()
        if norm is not None and norm not in self.dists:
            return iter(())
        hidden = DistributionFinder.Context(name=name, path=self.hidden)
        return (d for d in MetadataPathFinder.find_distributions(hidden)
                if d.metadata["Name"].replace("_", "-").replace(".", "-").lower() in self.dists)


def _install() -> None:
    config = os.environ.get("SLIPSTREAM_GPU_GUARD")
    if not config:
        return
    with open(config) as f:
        cfg = json.load(f)
    paths = sysconfig.get_paths()
    stdlib = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib")}
    keep = [os.path.realpath(d) for d in cfg["dirs"]]

    def visible(entry: str) -> bool:
        real = os.path.realpath(entry or os.getcwd())
        if real in keep:
            return True
        inside_stdlib = any(real == s or real.startswith(s + os.sep) for s in stdlib)
        return inside_stdlib and "site-packages" not in real and "dist-packages" not in real

    hidden = [p for p in sys.path if not visible(p)]
    sys.path[:] = [p for p in sys.path if visible(p)]
    sys.meta_path.insert(0, _Guard(cfg, hidden))


_install()
