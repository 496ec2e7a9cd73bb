"""One offline vLLM engine run for the engine tests (run in the engine venv, one process per engine).

    python tests/engine/engine_run.py --model DIR --kv-cache-dtype auto|ultraquant_4bit --out run.json
        [--score other.json] [--dump-layer model.layers.2.self_attn.attn --dump layer.pt]

Greedy continuations of :data:`PROMPTS` and of the chat :data:`CHAT` with their token ids, log-probs,
the margin between the engine's top two tokens at each position (where a small cache error could flip
the greedy choice) and the text of every prefix, and the KV capacity the engine allocated (blocks x
block size in ``VLLM_CPU_KVCACHE_SPACE`` GiB). ``--score`` also scores another run's continuations
(the prompts', then the chat's) under this run's model (prompt log-probs: the continuation's token and
the top token at each position). ``--dump-layer`` hooks UltraQuant's ``do_kv_cache_update`` of one
layer and saves the first batch's K, V, slot mapping and the cache bytes the engine wrote for them.
The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the hook sees it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

PROMPTS = [
    "The capital of France is",
    "The three primary colors are",
    "Water boils at a temperature of",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_MAX_TOKENS = 16
"""Greedy tokens of the chat answer, offline and from the server (the server test compares their prefixes)."""
MAX_MODEL_LEN = 512


def engine_kwargs(model: str, kv_cache_dtype: str) -> dict[str, Any]:
    """The one engine configuration every test uses (small: 512 tokens, eager, bf16)."""
    return dict(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=MAX_MODEL_LEN,
                kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False, seed=0)


def install_dump(layer_name: str, path: Path) -> None:
    """Save the first K/V batch one layer stores, and the cache bytes the engine wrote for it."""
    import torch

    from ultraquant.vllm import backend, spec

    original = backend.UltraQuantImpl.do_kv_cache_update

    def hooked(self: Any, layer: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        original(self, layer, key, value, kv_cache, slot_mapping)
        if getattr(layer, "layer_name", None) != layer_name or path.exists():
            return
        n = slot_mapping.shape[0]
        slots = slot_mapping.to(torch.int64)
        cache = spec.ops_cache_view(kv_cache)  # (blocks, block_size, Hk, slot bytes)
        bs = cache.shape[1]
        keep = slots >= 0
        written = cache[slots[keep] // bs, slots[keep] % bs]
        torch.save({"key": key[:n][keep].clone(), "value": value[:n][keep].clone(),
                    "slots": slots[keep].clone(), "cache_bytes": written.clone(),
                    "cache_shape": list(kv_cache.shape), "cache_stride": list(kv_cache.stride())}, path)

    backend.UltraQuantImpl.do_kv_cache_update = hooked


def score(llm: Any, other: dict) -> list[dict]:
    """Log-prob of each of ``other``'s continuation tokens under this engine, and of the top token there."""
    from vllm import SamplingParams

    runs = [*other["prompts"], other["chat"]]
    inputs = [{"prompt_token_ids": p["prompt_token_ids"] + p["token_ids"]} for p in runs]
    outs = llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    result = []
    for p, out in zip(runs, outs, strict=True):
        start = len(p["prompt_token_ids"])
        token_lp, top_lp = [], []
        for pos, tok in enumerate(p["token_ids"]):
            entry = out.prompt_logprobs[start + pos]
            token_lp.append(entry[tok].logprob)
            top_lp.append(max(lp.logprob for lp in entry.values()))
        result.append({"token_logprob": token_lp, "top_logprob": top_lp})
    return result


def continuation(out: Any, tokenizer: Any) -> dict:
    """One greedy output (generated with ``logprobs=2``) as the tests read it."""
    c = out.outputs[0]
    ids = list(c.token_ids)
    margins = []
    for lp in c.logprobs:
        top = sorted((x.logprob for x in lp.values()), reverse=True)
        margins.append(top[0] - top[1])
    return {
        "prompt_token_ids": list(out.prompt_token_ids),
        "token_ids": ids,
        "text": c.text,
        "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, ids, strict=True)],
        "margins": margins,
        "prefix_texts": [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--score", type=Path)
    ap.add_argument("--dump-layer")
    ap.add_argument("--dump", type=Path)
    args = ap.parse_args()
    if args.dump_layer:
        install_dump(args.dump_layer, args.dump)

    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args.model, args.kv_cache_dtype))
    startup = time.perf_counter() - t0
    t1 = time.perf_counter()
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=2)
    outs = llm.generate(PROMPTS, greedy)
    generate = time.perf_counter() - t1
    chat = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=CHAT_MAX_TOKENS, logprobs=2))[0]
    tokenizer = llm.get_tokenizer()
    cache = llm.llm_engine.vllm_config.cache_config
    doc: dict[str, Any] = {
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_space_gib": float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "nan")),
        "num_blocks": int(cache.num_gpu_blocks),
        "block_size": int(cache.block_size),
        "startup_s": round(startup, 1),
        "generate_s": round(generate, 1),
        "prompts": [{"prompt": o.prompt, **continuation(o, tokenizer)} for o in outs],
        "chat": continuation(chat, tokenizer),
    }
    doc["kv_tokens"] = doc["num_blocks"] * doc["block_size"]
    if args.score:
        doc["scores"] = score(llm, json.loads(args.score.read_text()))
    args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
