"""``slipstream tokenizer export DIR``: the served model's tokenizer as a Hugging Face tokenizer
directory (``tokenizer.json``, ``tokenizer_config.json`` with the chat template, special tokens),
so tools that want a local tokenizer (guidellm ``--processor``, lm-eval ``tokenizer=``, aiperf)
get the exact one the server uses, without a model hub."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slipstream tokenizer",
                                description="Work with the tokenizer of a model slipstream serves.")
    sub = p.add_subparsers(dest="action", required=True)
    export = sub.add_parser("export", help="write the model's tokenizer as a Hugging Face tokenizer directory")
    export.add_argument("directory", type=Path, help="where to write it (created; existing files are replaced)")
    export.add_argument("--model", default="builtin",
                        help="'builtin', a .gguf file or a Hugging Face checkpoint directory (as `serve --model`)")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    from slipstream.server.models.loader import ModelLoadError, load_tokenizer

    try:
        tokenizer = load_tokenizer(args.model)
    except ModelLoadError as exc:
        print(f"slipstream tokenizer: {exc}", file=sys.stderr)
        return 1
    args.directory.mkdir(parents=True, exist_ok=True)
    written = tokenizer.save_pretrained(str(args.directory))
    print(f"wrote {type(tokenizer).__name__} ({len(tokenizer)} tokens) to {args.directory}: "
          f"{', '.join(sorted(Path(f).name for f in written))}")
    return 0
