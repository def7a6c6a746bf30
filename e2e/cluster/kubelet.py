"""The process kubelet (see kubelet/__init__.py):

    .venv/bin/python e2e/cluster/kubelet.py --kubeconfig build/cluster/kubeconfig --node-name node-1
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kubelet.main import main  # noqa: E402  (the package next to this file)

if __name__ == "__main__":
    sys.exit(main())
