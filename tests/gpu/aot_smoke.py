"""Store + decode + prefill served from AOT blobs only, checked against the reference (a script).

Run by tests/gpu/test_runtime_gpu.py in a subprocess:
* ``--no-triton``: importing ``triton`` fails (the "offline" install: blobs, no JIT compiler);
* under ``compute-sanitizer --tool memcheck``: AOT launches with arguments packed by our loader.
Prints ``AOT-SMOKE OK`` and exits 0 when every output matches; needs ULTRAQUANT_GENERATED (or
generated/) to hold blobs for D=128, GQA 4, block 16, bf16.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    if "--no-triton" in sys.argv:
        sys.modules["triton"] = None  # type: ignore[assignment]  # `import triton` now raises
    os.environ["ULTRAQUANT_BACKEND"] = "aot"  # a miss raises: nothing may silently fall back
    import torch

    import ultraquant as uq
    from ultraquant import reference as R
    from ultraquant.runtime import launch

    torch.manual_seed(0)
    dev = "cuda"
    hq, hk, d, bs = 32, 8, 128, 16
    lens = [700, 1, 130]
    nblocks = sum(-(-n // bs) for n in lens) + 2
    cache = torch.zeros(nblocks, bs, hk, uq.slot_size(d), dtype=torch.uint8, device=dev)
    perm = torch.randperm(nblocks, device="cpu").tolist()
    table = torch.zeros(len(lens), max(-(-n // bs) for n in lens), dtype=torch.int32)
    slots = []
    for i, n in enumerate(lens):
        ids = [perm.pop() for _ in range(-(-n // bs))]
        table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(n)
        slots.append(table[i, pos // bs].long() * bs + pos % bs)
    table = table.to(dev)
    slot_mapping = torch.cat(slots).to(dev)
    key = torch.randn(sum(lens), hk, d, device=dev, dtype=torch.bfloat16)
    value = torch.randn(sum(lens), hk, d, device=dev, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)

    uq.store_kv(key, value, cache, slot_mapping)
    want = torch.zeros_like(cache)
    R.store_kv(key, value, want, slot_mapping)
    torch.cuda.synchronize()
    lay = uq.format.SlotLayout(d)
    assert torch.equal(cache[..., lay.v_codes:], want[..., lay.v_codes:]), "store: V bytes differ"
    k_bad = int((cache[..., : lay.v_codes] != want[..., : lay.v_codes]).sum())
    assert k_bad <= 1e-4 * cache[..., : lay.v_codes].numel(), f"store: {k_bad} K bytes differ"

    query = torch.randn(len(lens), hq, d, device=dev, dtype=torch.bfloat16)
    out = torch.full_like(query, float("nan"))
    uq.decode_attention(query, cache, table, seq_lens, d ** -0.5, out=out)
    ref = R.decode_attention(query.float(), cache, table, seq_lens, d ** -0.5)
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    assert err < 1e-2, f"decode rel err {err}"

    # prefill: the last 9 tokens of request 0 and all 130 of request 2 are the new chunk
    starts = [0, 9, 9, 139]
    rows = torch.cat([torch.arange(691, 700), torch.arange(701, 831)]).to(dev)
    q2 = torch.randn(139, hq, d, device=dev, dtype=torch.bfloat16)
    qsl = torch.tensor(starts, dtype=torch.int32, device=dev)
    lens2 = torch.tensor([700, 0, 130], dtype=torch.int32, device=dev)
    out2 = torch.full_like(q2, float("nan"))
    uq.prefill_attention(q2, key[rows], value[rows], cache, table, lens2, qsl, d ** -0.5, out=out2)
    ref2 = R.prefill_attention(q2.float(), key[rows].float(), value[rows].float(), cache, table, lens2, qsl,
                               d ** -0.5)
    err2 = float((out2.double() - ref2.double()).norm() / ref2.double().norm())
    assert err2 < 1e-2, f"prefill rel err {err2}"
    torch.cuda.synchronize()
    used = sorted({k for (_, k), st in launch.state().items() if not isinstance(st, launch.Miss)})
    print(f"AOT-SMOKE OK decode {err:.2e} prefill {err2:.2e} K-bytes-differing {k_bad} "
          f"triton-imported={'triton' in sys.modules and sys.modules['triton'] is not None} blobs={len(used)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
