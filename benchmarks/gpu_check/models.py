"""Random-weight Llama checkpoints of real shapes, written as Hugging Face directories.

Model files cannot travel (64 MiB in all), so the GPU check builds its models: a ``LlamaConfig``
of a real model's shape, ``LlamaForCausalLM`` initialized from a fixed seed (transformers' own
init: normal, std ``initializer_range``), saved as bf16 safetensors beside the built-in model's
tokenizer files. Both slipstream (``LLM(model=dir)``) and transformers (``from_pretrained``) load
the same directory, so an fp32 run upcasts the same bf16 values on both sides. The vocabulary is
the built-in tokenizer's (49,152 tokens) for every shape, so every sampled id detokenizes.

Usage: ``python models.py --tokenizer DIR --dest DIR --shapes smollm2-135m,llama-3.2-1b [--device cuda] [--json F]``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

# Shapes of the public configs (SmolLM2-135M-Instruct, Llama-3.2-1B), vocabulary aside.
SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, rope_theta=500000.0, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}


def write_random_model(shape: str, dest: Path, tokenizer_dir: Path, device: str = "cpu", seed: int = 0,
                       num_layers: int | None = None) -> dict:
    """Write ``dest`` (``config.json``, ``model.safetensors`` in bf16, tokenizer files) for ``shape``.

    The config has no EOS id, so transformers' ``generate`` always makes ``max_new_tokens`` (the
    engine's side uses ``ignore_eos``). ``num_layers`` overrides the depth (CPU rehearsals).
    Returns ``{"path", "parameters", "seconds"}``.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    kwargs = dict(SHAPES[shape])
    if num_layers:
        kwargs["num_hidden_layers"] = num_layers
    cfg = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=None, pad_token_id=None,
                      initializer_range=0.02, **kwargs)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(str(dest))
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, dest / f.name)
    params = sum(p.numel() for p in model.parameters())
    del model
    return {"path": str(dest), "parameters": params, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--dest", type=Path, required=True, help="one folder per shape is written under it")
    p.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    out = {}
    for shape in args.shapes.split(","):
        out[shape] = write_random_model(shape, args.dest / shape, args.tokenizer, args.device,
                                        num_layers=args.num_layers)
        print(f"{shape}: {out[shape]}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
