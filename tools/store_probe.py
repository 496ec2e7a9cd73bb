"""Where the large store's time goes (issue 14 Also): one GPU run of timed rows next to the ceiling.

The store of N=16384 tokens x 8 kv heads x D=128 (bf16 in) took ~63 us in every launch shape (v2 and
v3). This times, in one process and as CUDA-graph replays (``ultraquant.bench.decode.time_graph``):
the store itself, no-math streams with the store's grid and exactly its load and store patterns
(rows on lanes, as v3, or coalesced), candidate stores, and torch copies of the same bytes as anchors.
The no-math kernel ``probe_stream`` XORs the loaded K/V words (no encoding) and writes 136-byte slots.

    python tools/store_probe.py --out DIR      (GPU; writes DIR/probe.json and DIR/probe.log)
    python tools/store_probe.py --cpu          (CPU: every kernel through Triton's interpreter, checked)
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "--cpu" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit functions are defined

import argparse
import dataclasses
import json
import time

import torch
import triton
import triton.language as tl

from ultraquant.kernels.triton.common import slot_rows

D = 128
HK = 8
SLOT = 136
"""The bench's store shape: D=128 bf16 rows, 8 kv heads, 136-byte slots (ultraquant.slot_size(128))."""


@triton.jit
def probe_stream(key_ptr, value_ptr, cache_ptr, slot_ptr, err_ptr, n_rows, num_kv_heads, block_size, num_slots,
                 stride_kn, stride_kh, stride_vn, stride_vh, stride_cb, stride_ct, stride_ch,
                 W: tl.constexpr, R: tl.constexpr, ALIGN: tl.constexpr, LOADS: tl.constexpr,
                 STORES: tl.constexpr):
    """No-math stand-in for uq_store_kv: the same rows, slots and slot addresses (:func:`slot_rows`,
    error word included); K/V rows read as
    ``W`` int32 words (strides in words). LOADS 0: none (words from the row index), 1: v3's pattern
    (``[R, W/4, 4]``: rows on lanes, one 16-byte vector per lane and instruction), 2: coalesced
    (``[R, W]``: a row's 16-byte vectors over consecutive lanes). ``x = k ^ v``, word pairs XORed:
    ``w [R, W/2]``, its XOR ``t``. STORES 0: ``t`` at slot word 0 only; 1: v3's pattern (words as
    ``ALIGN``-byte vectors, rows on lanes: 16 + 1 STG.64 per row at W=64); 2: coalesced (a row's
    words over lanes); both write ``w`` then ``[t, t ^ 1]`` (136 bytes)."""
    tok, head, off, valid = slot_rows(tl.program_id(0), slot_ptr, err_ptr, n_rows, num_kv_heads, block_size,
                                      num_slots, stride_cb, stride_ct, stride_ch, R, ALIGN)
    dst = cache_ptr + off
    rows = tl.program_id(0) * R + tl.arange(0, R)
    tok64 = tok.to(tl.int64)
    koff = (tok64 * (stride_kn >> 2) + head * (stride_kh >> 2)) * 4
    voff = (tok64 * (stride_vn >> 2) + head * (stride_vh >> 2)) * 4
    if LOADS == 1:
        cols = tl.arange(0, W // 4)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
        k = tl.load(key_ptr + koff[:, None, None] + cols, mask=valid[:, None, None], other=0)
        v = tl.load(value_ptr + voff[:, None, None] + cols, mask=valid[:, None, None], other=0)
        x = tl.reshape(k ^ v, [R, W])
    elif LOADS == 2:
        cols = tl.arange(0, W)[None, :]
        k = tl.load(key_ptr + koff[:, None] + cols, mask=valid[:, None], other=0)
        v = tl.load(value_ptr + voff[:, None] + cols, mask=valid[:, None], other=0)
        x = k ^ v
    else:
        x = rows[:, None] * W + tl.arange(0, W)[None, :]
    a, b = tl.split(tl.reshape(x, [R, W // 2, 2]))
    w = a ^ b
    t = tl.xor_sum(w, axis=1)
    wp = dst.to(tl.pointer_type(tl.int32))
    if STORES == 0:
        tl.store(wp, t, mask=valid)
    else:
        tail = t[:, None] ^ tl.arange(0, 2)[None, :]
        if STORES == 1:
            V: tl.constexpr = 2 if ALIGN >= 8 else 1
            cols = tl.arange(0, W // 2 // V)[None, :, None] * V + tl.arange(0, V)[None, None, :]
            tl.store(wp[:, None, None] + cols, tl.reshape(w, [R, W // 2 // V, V]), mask=valid[:, None, None])
            tcols = W // 2 + tl.arange(0, 2 // V)[None, :, None] * V + tl.arange(0, V)[None, None, :]
            tl.store(wp[:, None, None] + tcols, tl.reshape(tail, [R, 2 // V, V]), mask=valid[:, None, None])
        else:
            tl.store(wp[:, None] + tl.arange(0, W // 2)[None, :], w, mask=valid[:, None])
            tl.store(wp[:, None] + W // 2 + tl.arange(0, 2)[None, :], tail, mask=valid[:, None])


@dataclasses.dataclass
class Problem:
    """K/V of ``n`` tokens, a token-major cache (the bench's: blocks of 64) and its slot mapping."""

    key: torch.Tensor
    value: torch.Tensor
    cache: torch.Tensor
    slots: torch.Tensor

    @property
    def rows(self) -> int:
        return self.key.shape[0] * self.key.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes read + written as ``ultraquant bench`` counts a store (bf16 K and V, one slot)."""
        return self.rows * (4 * D + SLOT)


def make_problem(n: int, device: str, sequential: bool = False, seed: int = 0) -> Problem:
    """The bench_store problem (random slot permutation), or ``sequential`` slots 0..n-1."""
    gen = torch.Generator(device=device).manual_seed(seed)
    key = torch.randn(n, HK, D, device=device, dtype=torch.bfloat16, generator=gen)
    value = torch.randn(n, HK, D, device=device, dtype=torch.bfloat16, generator=gen)
    nblk = -(-n // 64) + 1
    cache = torch.zeros(nblk, 64, HK, SLOT, dtype=torch.uint8, device=device)
    slots = (torch.arange(n, device=device) if sequential
             else torch.randperm(nblk * 64, device=device, generator=gen)[:n])
    return Problem(key, value, cache, slots)


def stream_launch(p: Problem, loads: int, stores: int, rows: int = 32, warps: int = 1):
    """A callable that runs :func:`probe_stream` once on ``p``."""
    k32, v32 = p.key.view(torch.int32), p.value.view(torch.int32)
    c = p.cache
    grid = (triton.cdiv(p.rows, rows),)
    err = torch.zeros(8, dtype=torch.int32, device=c.device)

    def launch() -> None:
        probe_stream[grid](k32, v32, c, p.slots, err, p.rows, HK, c.shape[1], c.shape[0] * c.shape[1],
                           k32.stride(0), k32.stride(1),
                           v32.stride(0), v32.stride(1), c.stride(0), c.stride(1), c.stride(2),
                           W=D // 2, R=rows, ALIGN=8, LOADS=loads, STORES=stores, num_warps=warps)
    return launch


def stream_expected(p: Problem, loads: int, stores: int) -> torch.Tensor:
    """The cache :func:`probe_stream` leaves (torch on the same device; the slots must be valid)."""
    if loads:
        x = (p.key.view(torch.int32) ^ p.value.view(torch.int32)).reshape(p.rows, D // 2)
    else:
        x = (torch.arange(p.rows, device=p.key.device)[:, None] * (D // 2)
             + torch.arange(D // 2, device=p.key.device)[None, :]).to(torch.int32)
    w = x[:, 0::2] ^ x[:, 1::2]
    t = w[:, 0].clone()
    for j in range(1, w.shape[1]):
        t ^= w[:, j]
    out = p.cache.clone()
    words = out.view(-1, HK, SLOT).view(torch.int32)  # [slots, HK, 34]
    ok = p.slots >= 0
    rows_ok = ok.repeat_interleave(HK)
    slot_words = words[p.slots[ok]].reshape(-1, SLOT // 4)
    if stores == 0:
        slot_words[:, 0] = t[rows_ok]
    else:
        slot_words[:, : D // 4] = w[rows_ok]
        slot_words[:, D // 4] = t[rows_ok]
        slot_words[:, D // 4 + 1] = t[rows_ok] ^ 1
    words[p.slots[ok]] = slot_words.reshape(-1, HK, SLOT // 4)
    return out


def candidate_launch(p: Problem, registry, rows: int, warps: int, lanes: int, maxnreg: int | None = None):
    """A callable running ``registry``'s store kernel on ``p`` as the bench's launch shape (``rows`` per
    program of ``warps`` warps, ``lanes`` lanes per row; -1: v3's whole rows with V loaded together
    with K; ``maxnreg``)."""
    from ultraquant.bench.decode import store_variant_launch

    launch = store_variant_launch(p.key, p.value, p.cache, p.slots, (rows, warps, lanes < 0, lanes, maxnreg))
    return lambda: registry.jit_launch(launch)


CANDIDATES = ((32, 4, 16, None), (32, 4, 8, None), (32, 4, 4, None), (16, 1, 2, None), (16, 1, 8, None),
              (8, 1, 4, None), (8, 4, 8, None), (32, 1, -1, 168), (32, 1, -1, 144), (32, 1, -1, None))
"""(rows per program, warps, lanes per row, maxnreg) of the store candidates timed on the GPU (lanes -1:
v3's whole rows with V loaded up front)."""
STREAMS = ((1, 1), (2, 1), (1, 2), (2, 2), (1, 0), (2, 0), (0, 1), (0, 2))
"""(LOADS, STORES) of the no-math streams timed on the GPU (v3's grid: 32 rows, 1 warp)."""


def cpu_check() -> None:
    """Every probe kernel on small CPU problems (interpreter): streams against :func:`stream_expected`,
    candidates against ultraquant.reference (bytes, K near-tie rule of the store tests)."""
    from tests.test_kernels_store import assert_store_matches
    from ultraquant import reference as R
    from ultraquant.kernels.interpret import interpreted_registry

    registry = interpreted_registry()
    for loads, stores in STREAMS:
        p = make_problem(37, "cpu", seed=loads * 3 + stores)
        p.slots[3] = -1
        want = stream_expected(p, loads, stores)
        stream_launch(p, loads, stores)()
        assert torch.equal(p.cache, want), f"stream loads={loads} stores={stores} differs"
        print(f"stream loads={loads} stores={stores}: ok", flush=True)
    for rows, warps, lanes, maxnreg in CANDIDATES:
        for n in (45, 3):
            p = make_problem(n, "cpu", seed=rows + n + lanes)
            p.key *= 2
            if n > 2:
                p.slots[2] = -1
            ref = p.cache.clone()
            candidate_launch(p, registry, rows, warps, lanes, maxnreg)()
            R.store_kv(p.key, p.value, ref, p.slots)
            assert_store_matches(p.cache, ref, D)
        print(f"candidate rows={rows} warps={warps} lanes={lanes} maxnreg={maxnreg}: ok", flush=True)


def gpu_run(out: str | None, smoke: bool = False) -> None:
    """Time every row (CUDA-graph replay, GPU alone), check the streams' and candidates' bytes, list the
    kernels one ``ultraquant.store_kv`` call launches (profiler), write probe.json / probe.log.
    ``smoke``: the same flow on the CPU (interpreter, 16 tokens, wall-clock "timings"): no typos left
    for the device run."""
    import ultraquant as uq

    if smoke:
        from ultraquant.kernels.interpret import interpreted_registry

        os.environ["ULTRAQUANT_BACKEND"] = "triton"
        registry = interpreted_registry()
        dev, n_big, n_small = "cpu", 16, 8

        def time_graph(fn) -> float:
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6

        def measure_ceiling() -> float:
            return 1.0
    else:
        from ultraquant.bench.decode import measure_ceiling, time_graph
        from ultraquant.kernels import registry

        dev, n_big, n_small = "cuda", 16384, 64

    t0 = time.time()
    lines: list[str] = []
    result: dict = {"rows": [], "checks": {}}

    def log(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    ceiling = measure_ceiling()
    result["ceiling_tbps"] = ceiling
    name = torch.cuda.get_device_name() if dev == "cuda" else dev
    log(f"ceiling {ceiling:.2f} TB/s; {name}, torch {torch.__version__}, triton {triton.__version__}")

    def save() -> None:  # after every row: a timeout keeps what was measured
        if out:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "probe.json"), "w") as f:
                json.dump(result, f, indent=1)
            with open(os.path.join(out, "probe.log"), "w") as f:
                f.write("\n".join(lines) + "\n")

    def row(name: str, fn, nbytes: int) -> None:
        try:
            us = time_graph(fn)
        except Exception as exc:  # one failing row must not lose the others
            log(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
            return
        tbps = nbytes / (us * 1e-6) / 1e12
        result["rows"].append(dict(name=name, us=us, bytes=nbytes, tbps=tbps, pct_ceiling=100 * tbps / ceiling))
        log(f"{name:<58} {us:8.2f} us {tbps:6.2f} TB/s {100 * tbps / ceiling:5.1f}%  ({time.time() - t0:.0f} s)")
        save()

    big = make_problem(n_big, dev)
    seq = make_problem(n_big, dev, sequential=True, seed=1)
    small = make_problem(n_small, dev, seed=2)
    for name, p in (("", big), (" sequential slots", seq), (" (decode step)", small)):
        row(f"store N={p.key.shape[0]}{name}", lambda p=p: uq.store_kv(p.key, p.value, p.cache, p.slots), p.nbytes)
    for loads, stores in STREAMS:
        row(f"stream loads={('none', 'rows', 'coalesced')[loads]} stores={('word', 'rows', 'coalesced')[stores]}",
            stream_launch(big, loads, stores), big.nbytes)
    row("stream loads=rows stores=rows sequential slots", stream_launch(seq, 1, 1), seq.nbytes)
    row("stream loads=coalesced stores=coalesced 32 rows 4 warps", stream_launch(big, 2, 2, 32, 4), big.nbytes)
    # Anchors: torch kernels moving the same kinds of bytes (counted read + written).
    kd, vd = torch.empty_like(big.key), torch.empty_like(big.value)
    row("torch copy_ of K and V (67 MB read + 67 MB written)", lambda: (kd.copy_(big.key), vd.copy_(big.value)),
        4 * big.key.numel() * 2)
    words = big.cache.view(-1).view(torch.int32)
    src = torch.randint(-(2**31), 2**31 - 1, (big.key.shape[0], HK * SLOT // 4), dtype=torch.int32, device=dev)
    dense = words[: src.numel()]
    row("torch copy_ 17.8 MB dense (slot bytes, no scatter)", lambda: dense.copy_(src.view(-1)), 2 * src.numel() * 4)
    per_token = words.view(-1, HK * SLOT // 4)
    row("torch index_copy_ of 1088-byte tokens at the slots", lambda: per_token.index_copy_(0, big.slots, src),
        2 * src.numel() * 4)
    for rows, warps, lanes, maxnreg in CANDIDATES:
        for p in (big, small):
            name = f"lanes store N={p.key.shape[0]} rows {rows} warps {warps} lanes {lanes}"
            row(name + (f" maxnreg {maxnreg}" if maxnreg else ""),
                candidate_launch(p, registry, rows, warps, lanes, maxnreg), p.nbytes)
    # Checks (bytes): the candidates against the current store, two streams against torch.
    for loads, stores in ((1, 1), (2, 2)):
        big.cache.zero_()
        stream_launch(big, loads, stores)()
        result["checks"][f"stream {loads}/{stores}"] = bool(torch.equal(big.cache, stream_expected(big, loads, stores)))
    for p in (big, small):
        p.cache.zero_()
        uq.store_kv(p.key, p.value, p.cache, p.slots)
        want = p.cache.clone()
        for rows, warps, lanes, maxnreg in CANDIDATES:
            p.cache.zero_()
            candidate_launch(p, registry, rows, warps, lanes, maxnreg)()
            diff = int((p.cache != want).sum())
            key = f"{rows}x{warps} lanes {lanes} maxnreg {maxnreg} N={p.key.shape[0]}: bytes != store_kv"
            result["checks"][key] = diff
    log(f"checks: {result['checks']}")
    from torch.profiler import ProfilerActivity, profile

    if dev == "cuda":
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if dev == "cuda" else ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            uq.store_kv(big.key, big.value, big.cache, big.slots)
        if dev == "cuda":
            torch.cuda.synchronize()
    kernels = [(e.key, e.count, e.device_time_total / max(e.count, 1)) for e in prof.key_averages()
               if e.device_time_total > 0 or smoke][:12]
    result["profile_store_kv_3_calls"] = kernels
    for name, count, us in kernels:
        log(f"profiled (3 store_kv calls): {name[:70]} x{count} {us:.1f} us each")
    log(f"total {time.time() - t0:.0f} s")
    save()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="check every kernel on the CPU (interpreter) and stop")
    ap.add_argument("--smoke", action="store_true", help="with --cpu: the GPU run's flow on the CPU instead")
    ap.add_argument("--out", default=None, help="directory for probe.json and probe.log")
    args = ap.parse_args(argv)
    if args.cpu:
        if args.smoke:
            gpu_run(args.out, smoke=True)
        else:
            cpu_check()
        return
    gpu_run(args.out)


if __name__ == "__main__":
    main()
