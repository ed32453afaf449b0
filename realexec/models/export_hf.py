"""`python -m realexec export-hf --out DIR`: a model as a plain fp32 Hugging Face directory.

For engines that load HF directories (vLLM, transformers) on exactly the weights
twinserve runs: a GGUF (default: the embedded SmolLM2-135M-Instruct Q4_1) is converted
by our loader (dequantized to fp32, llama q/k rows un-permuted, tokenizer from the GGUF
metadata) and the directory is copied to DIR: config.json, model.safetensors, tokenizer
files. An HF directory given as --model is copied as is.
"""
from __future__ import annotations

import shutil
from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None,
                        help="GGUF file, or a directory with one *.gguf or an HF checkpoint "
                             "[the embedded SmolLM2-135M-Instruct GGUF]")
    parser.add_argument("--out", required=True, help="directory to write (must not exist, or be empty)")


def export_hf(model: str | None, out: str | Path) -> Path:
    from realexec.models.loader import resolve_model_dir

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out}: exists and is not an empty directory")
    src = resolve_model_dir(model)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file():
            shutil.copy2(f, out / f.name)
    return out


def run(args) -> int:
    import json

    out = export_hf(args.model, args.out)
    cfg = json.loads((out / "config.json").read_text())
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(f"wrote {out}: {cfg.get('architectures', ['?'])[0]}, {cfg.get('num_hidden_layers')} layers, "
          f"{cfg.get('torch_dtype')}, {size:.0f} MiB ({', '.join(sorted(f.name for f in out.iterdir()))})")
    return 0
