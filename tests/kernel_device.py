"""The device the kernel tests run on, decided once per process before anything imports triton.

CUDA when present (compiled Triton kernels on CUDA tensors; the interpreter is removed from the
environment, it must never be on in a CUDA run), else CPU tensors in Triton's interpreter
(``TRITON_INTERPRET=1``: Triton 3.9 reads it when triton.language is first imported, when our
kernels are decorated, and again at launch, so it stays set for the whole session).
``SLIPSTREAM_TEST_DEVICE=cpu`` forces the interpreter on a CUDA machine.
"""
from __future__ import annotations

import os

import torch

DEVICE = torch.device(os.environ.get("SLIPSTREAM_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))
if DEVICE.type == "cuda":
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = "1"
