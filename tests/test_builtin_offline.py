"""``--model builtin`` without offline mode: the server images no longer set HF_HUB_OFFLINE, so
loading the packaged GGUF, converting its tokenizer (a fresh cache) and rendering its chat
template must open no connection by themselves."""
from __future__ import annotations

import json
import os
import subprocess
import sys

# Run in a fresh interpreter: huggingface_hub reads HF_HUB_OFFLINE once, at import. Every DNS
# lookup and connect is recorded and refused; a Hub call at the end shows the guard sees one.
SCRIPT = r"""
import json, socket, sys
calls = []
def connect(self, address):
    calls.append(repr(address)); raise OSError("network blocked by the test")
def getaddrinfo(host, *args, **kwargs):
    calls.append(repr(host)); raise socket.gaierror("network blocked by the test")
socket.socket.connect = connect
socket.getaddrinfo = getaddrinfo
import torch
from slipstream.server.models.loader import load_model, load_tokenizer
loaded = load_model("builtin", torch.device("cpu"), torch.float32)
loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
load_tokenizer("builtin")
builtin = list(calls)
import huggingface_hub
try:
    huggingface_hub.HfApi(endpoint="http://hub.invalid").model_info("org/name")
except Exception:
    pass
print(json.dumps({"builtin": builtin, "guard": calls[len(builtin):]}))
"""


def test_the_builtin_model_loads_without_the_network_and_without_offline_mode(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(SLIPSTREAM_CACHE_DIR=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    calls = json.loads(out.stdout.strip().splitlines()[-1])
    assert calls["builtin"] == []
    assert calls["guard"]  # the guard does see a Hub request
