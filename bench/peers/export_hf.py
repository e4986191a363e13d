"""Write the GGUF model as a plain HF directory (fp32 safetensors + tokenizer).

    .venv-bench/bin/python bench/peers/export_hf.py --model SmolLM2.gguf --out /tmp/smollm2-hf

For servers that cannot load the GGUF themselves: `transformers serve DIR:FILE.gguf` fails on
it (the GGUF's config names no `architectures`), and a model loaded from a GGUF refuses
`save_pretrained` ("quantized with gguf"), so the dequantized weights are copied into a fresh
model of the same config first.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the GGUF file")
    ap.add_argument("--out", required=True, help="directory to write")
    a = ap.parse_args()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(a.model)
    src = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                               dtype=torch.float32)
    cfg = src.config
    cfg.architectures = [type(src).__name__]
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    dst = getattr(transformers, type(src).__name__)(cfg).to(torch.float32)
    dst.load_state_dict(src.state_dict())
    dst.save_pretrained(a.out)
    AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name).save_pretrained(a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
