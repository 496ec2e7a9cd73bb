"""Which op path should serve vLLM's CPU platform: the reference, or the Triton kernels interpreted?

One decode step of one SmolLM2-135M attention layer as the engine runs it (9 query / 3 kv heads,
D=64, block 128, bf16, 3 requests at 64 tokens of context): store the new token, then decode. Run in
the dev venv (it has the pinned triton), once per path, each in a fresh process (TRITON_INTERPRET
is read when the kernels are defined):

    python tests/engine/cpu_decode_step.py --out benchmarks/results/vllm_cpu_decode_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HQ, HK, D, BLOCK, NREQ, CTX, REPS = 9, 3, 64, 128, 3, 64, 5


def one_path() -> float:
    """Seconds per layer decode step on the path the environment selects (after one warm-up step)."""
    import torch

    from ultraquant.attention import AttentionMetadata, UltraQuantAttention

    torch.manual_seed(0)
    cache = torch.zeros(16, BLOCK, HK, 68, dtype=torch.uint8)
    layer = UltraQuantAttention(HQ, HK, D, scale=D ** -0.5, sliding_window=None, softcap=None)
    layer.setup(cache.device, max_num_reqs=8)
    rows = lambda n, h: torch.randn(n, h, D, dtype=torch.bfloat16)  # noqa: E731
    n = CTX * NREQ
    md = AttentionMetadata.build(query_lens=[CTX] * NREQ, seq_lens=[CTX] * NREQ,
                                 block_table=[[i] for i in range(NREQ)],
                                 slot_mapping=[i * BLOCK + j for i in range(NREQ) for j in range(CTX)])
    layer.forward(rows(n, HQ), rows(n, HK), rows(n, HK), cache, md)

    def step(pos: int) -> None:
        md = AttentionMetadata.build(query_lens=[1] * NREQ, seq_lens=[pos + 1] * NREQ,
                                     block_table=[[i] for i in range(NREQ)],
                                     slot_mapping=[i * BLOCK + pos for i in range(NREQ)])
        out = torch.empty(NREQ, HQ * D, dtype=torch.bfloat16)
        layer.forward(rows(NREQ, HQ), rows(NREQ, HK), rows(NREQ, HK), cache, md, out)

    step(CTX)
    t = time.perf_counter()
    for i in range(REPS):
        step(CTX + 1 + i)
    return (time.perf_counter() - t) / REPS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_path()))
        return
    paths = {"reference": {"ULTRAQUANT_BACKEND": "reference"},
             "triton_interpreter": {"ULTRAQUANT_BACKEND": "triton", "TRITON_INTERPRET": "1"}}
    result = {"shape": dict(hq=HQ, hk=HK, d=D, block=BLOCK, requests=NREQ, context=CTX, reps=REPS)}
    for name, extra in paths.items():
        env = {k: v for k, v in os.environ.items() if k not in ("ULTRAQUANT_BACKEND", "TRITON_INTERPRET")}
        out = subprocess.run([sys.executable, __file__, "--child"], env=env | extra, check=True,
                             capture_output=True, text=True).stdout
        result[f"{name}_s_per_layer_step"] = json.loads(out.strip().splitlines()[-1])
    result["interpreter_over_reference"] = (result["triton_interpreter_s_per_layer_step"]
                                            / result["reference_s_per_layer_step"])
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
