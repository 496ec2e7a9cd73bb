"""Garbage slot_mapping / block_table / seq_lens through store, decode, prefill and dequant (issue 17).

Shared by tests/gpu/test_bounds_gpu.py and tests/gpu/sanitize.py (compute-sanitizer memcheck). The
cache sits in the middle of a larger poisoned buffer, value checks are off (GPU tensors), and the
values include negatives, ids just past the end and the int32 extremes (2**31-1, -2**31; 2**32+5 in
an int64 slot_mapping). Each case checks: guard bytes unchanged, cache bytes unchanged except the
valid slots a store wrote, outputs equal to attention over the surviving tokens (bad blocks are
empty, lengths clamped to the row), and the error bits ``ultraquant.check_errors()`` reports.
On a CPU device the plans are launched directly (the public ops would reject the values first).
"""

from __future__ import annotations

import torch

import ultraquant as uq
from tests.helpers import fill_cache, guarded, guards_intact
from ultraquant import reference as R
from ultraquant.format import SlotLayout
from ultraquant.kernels import plans
from ultraquant.kernels.flags import KernelError

POISON = 0xF7
HUGE = (2**31 - 1, -(2**31))


def _garbage(gen: torch.Generator, num_blocks: int, n: int) -> list[int]:
    """``n`` out-of-range block ids / slots: the extremes, just past the end, negative, random large."""
    pool = [*HUGE, -1, num_blocks, num_blocks + 1]
    pool += torch.randint(num_blocks, 2**31 - 1, (4,), generator=gen).tolist()
    pool += torch.randint(-(2**31), -1, (4,), generator=gen).tolist()
    return [pool[int(i)] for i in torch.randint(0, len(pool), (n,), generator=gen)]


def _surviving(row: list[int], length: int, num_blocks: int, bs: int) -> tuple[list[int], int]:
    """The tokens a bounded kernel attends to: length clamped to the row, bad blocks dropped (only the
    last used block may be partial, so the survivors pack into a row of their own)."""
    length = min(max(length, 0), len(row) * bs)
    kept, n = [], 0
    for j in range(-(-length // bs)):
        used = min(bs, length - j * bs)
        if 0 <= row[j] < num_blocks:
            kept.append(row[j])
            n += used
    return kept + [0] * (len(row) - len(kept)), n


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


class Problem:
    """A poisoned-guard cache of valid random K/V on ``device``."""

    def __init__(self, device: str, seed: int, d: int = 128, hk: int = 2, gqa: int = 4, bs: int = 16,
                 num_blocks: int = 24) -> None:
        self.device, self.d, self.hk, self.hq, self.bs, self.nb = device, d, hk, hk * gqa, bs, num_blocks
        self.gen = torch.Generator().manual_seed(seed)
        block_bytes = bs * hk * uq.slot_size(d)
        self.cache, self.whole = guarded((num_blocks, bs, hk, uq.slot_size(d)), torch.uint8, POISON,
                                         2 * block_bytes, device)
        fill_cache(self.cache, d, seed)
        self.snapshot = self.whole.clone()

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(torch.bfloat16).to(self.device)

    def table(self, lens: list[int], cols: int, corrupt: int) -> tuple[torch.Tensor, list[list[int]]]:
        """A block table of distinct valid ids with ``corrupt`` used entries per row set to garbage."""
        ids = torch.randperm(self.nb, generator=self.gen)
        rows = [ids[(i * cols) % self.nb: (i * cols) % self.nb + cols].tolist() for i in range(len(lens))]
        rows = [r + [0] * (cols - len(r)) for r in rows]
        for r, n in zip(rows, lens, strict=True):
            used = max(1, min(cols, -(-max(n, 0) // self.bs)))
            for j, bad in zip(torch.randperm(used, generator=self.gen)[:corrupt].tolist(),
                              _garbage(self.gen, self.nb, corrupt), strict=False):
                r[j] = bad
        return torch.tensor(rows, dtype=torch.int32, device=self.device), rows

    def expected_table(self, rows: list[list[int]], lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        kept = [_surviving(r, n, self.nb, self.bs) for r, n in zip(rows, lens, strict=True)]
        return (torch.tensor([k for k, _ in kept], dtype=torch.int32, device=self.device),
                torch.tensor([n for _, n in kept], dtype=torch.int32, device=self.device))


def _check(failures: list[str], what: str, ok: bool) -> None:
    if not ok:
        failures.append(what)


def _flags(failures: list[str], what: str, want: KernelError) -> None:
    got = uq.check_errors()
    _check(failures, f"{what}: error bits {got!r}, expected {want!r}", got == want)


def _launch(device: str, op: str, *args, **kw) -> None:
    if device != "cpu":
        getattr(uq, op)(*args, **kw)
        return
    from ultraquant.kernels.interpret import interpreted_registry

    planner = {"store_kv": plans.plan_store, "decode_attention": plans.plan_decode,
               "prefill_attention": plans.plan_prefill, "dequant_kv_packed": plans.plan_dequant}[op]
    interpreted_registry().jit_launch(planner(*args, **kw))


def store_case(p: Problem, failures: list[str], slot_dtype: torch.dtype) -> None:
    n_slots = p.nb * p.bs
    good = torch.randperm(n_slots, generator=p.gen)[:12].tolist()
    bad = [-1, -(2**31), n_slots, n_slots + 1, 2**31 - 1] + _garbage(p.gen, n_slots, 6)
    if slot_dtype == torch.int64:
        bad.append(2**32 + 5)
    bad = [b for b in bad if not 0 <= b < n_slots]
    slots = torch.tensor(good + bad, dtype=slot_dtype)[torch.randperm(len(good) + len(bad), generator=p.gen)]
    key, value = p.randn(len(slots), p.hk, p.d), p.randn(len(slots), p.hk, p.d)
    want = p.cache.cpu().clone()
    inside = (slots >= 0) & (slots < n_slots)
    R.store_kv(key.cpu()[inside], value.cpu()[inside], want, slots[inside])
    _launch(p.device, "store_kv", key, value, p.cache, slots.to(p.device))
    _check(failures, f"store ({slot_dtype}): wrote outside the cache", guards_intact(p.whole, p.cache, POISON))
    got = p.cache.cpu()
    lay = SlotLayout(p.d)
    _check(failures, f"store ({slot_dtype}): V bytes / K scales / untouched slots differ",
           torch.equal(got[..., lay.k_scales:], want[..., lay.k_scales:]))
    diff = int((R.unpack_nibbles(got[..., : lay.k_scales]) != R.unpack_nibbles(want[..., : lay.k_scales])).sum())
    _check(failures, f"store ({slot_dtype}): {diff} K codes differ (near-ties allow a handful)", diff <= 4)
    _flags(failures, f"store ({slot_dtype})", KernelError.SLOT_OUT_OF_RANGE)
    p.snapshot = p.whole.clone()


def decode_case(p: Problem, failures: list[str], splits: int) -> None:
    cols = 6
    lens = [70, 96, 33, 2**31 - 1, 50, -(2**31), 17, 96]
    bt, rows = p.table(lens, cols, corrupt=2)
    bt[6] = bt[6].clone().fill_(0)  # a clean row whose length is fine: must come out exact
    rows[6] = [0] * cols
    q = p.randn(len(lens), p.hq, p.d)
    out = torch.full_like(q, float("nan"))
    seq = torch.tensor(lens, dtype=torch.int32, device=p.device)
    if p.device == "cpu":
        _launch(p.device, "decode_attention", q, p.cache, bt, seq, 0.1, None, None, None, out,
                plans.Tuning(decode_splits=splits))
    else:
        import os

        from ultraquant import config

        os.environ["ULTRAQUANT_DECODE_SPLITS"] = str(splits)
        config.reload()
        try:
            uq.decode_attention(q, p.cache, bt, seq, 0.1, out=out)
        finally:
            os.environ.pop("ULTRAQUANT_DECODE_SPLITS")
            config.reload()
    ebt, elen = p.expected_table(rows, lens)
    ref = R.decode_attention(q.float().cpu(), p.cache.cpu(), ebt.cpu(), elen.cpu(), 0.1)
    _check(failures, f"decode (splits {splits}): non-finite output", bool(torch.isfinite(out).all()))
    err = _rel(out, ref)
    _check(failures, f"decode (splits {splits}): rel err {err:.2e} against the surviving tokens", err < 1e-2)
    _check(failures, f"decode (splits {splits}): cache or guards changed", torch.equal(p.whole, p.snapshot))
    _flags(failures, f"decode (splits {splits})", KernelError.BLOCK_OUT_OF_RANGE | KernelError.SEQ_LEN_OUT_OF_RANGE)


def prefill_case(p: Problem, failures: list[str]) -> None:
    cols, q_lens, lens = 6, [3, 1, 5], [67, 80, 2**31 - 1]
    bt, rows = p.table(lens, cols, corrupt=0)
    for r, n, ql in zip(rows[:2], lens[:2], q_lens[:2], strict=True):  # garbage inside the cached prefix only
        for j, bad in zip(range((n - ql) // p.bs), _garbage(p.gen, p.nb, cols), strict=False):
            if j % 2:
                r[j] = bad
    bt = torch.tensor(rows, dtype=torch.int32, device=p.device)
    qsl = torch.tensor([0, 3, 4, 9], dtype=torch.int32, device=p.device)
    n = int(qsl[-1])
    q, k, v = p.randn(n, p.hq, p.d), p.randn(n, p.hk, p.d), p.randn(n, p.hk, p.d)
    out = torch.full_like(q, float("nan"))
    seq = torch.tensor(lens, dtype=torch.int32, device=p.device)
    if p.device == "cpu":
        _launch(p.device, "prefill_attention", q, k, v, p.cache, bt, seq, qsl, 0.1, None, None, None, out)
    else:
        uq.prefill_attention(q, k, v, p.cache, bt, seq, qsl, 0.1, out=out)
    ebt, elen = p.expected_table(rows[:2], lens[:2])
    ref = R.prefill_attention(q[:4].float().cpu(), k[:4].cpu(), v[:4].cpu(), p.cache.cpu(), ebt.cpu(), elen.cpu(),
                              qsl[:3].cpu(), 0.1)
    _check(failures, "prefill: non-finite output", bool(torch.isfinite(out).all()))
    err = _rel(out[:4], ref)
    _check(failures, f"prefill: rel err {err:.2e} against the surviving tokens", err < 1e-2)
    _check(failures, "prefill: cache or guards changed", torch.equal(p.whole, p.snapshot))
    _flags(failures, "prefill", KernelError.BLOCK_OUT_OF_RANGE | KernelError.SEQ_LEN_OUT_OF_RANGE)


def dequant_case(p: Problem, failures: list[str]) -> None:
    cols = 5
    lens = [70, 2**31 - 1, 33, -(2**31)]
    bt, rows = p.table(lens, cols, corrupt=2)
    cap = cols * p.bs
    clamped = [min(max(n, 0), cap) for n in lens]
    cu = torch.tensor([0, *torch.tensor(clamped).cumsum(0).tolist()], dtype=torch.int32, device=p.device)
    total = int(cu[-1])
    k_out, k_whole = guarded((total, p.hk, p.d), torch.float32, 1234.0, 4096, p.device)
    v_out, v_whole = guarded((total, p.hk, p.d), torch.float32, 1234.0, 4096, p.device)
    seq = torch.tensor(lens, dtype=torch.int32, device=p.device)
    if p.device == "cpu":
        _launch(p.device, "dequant_kv_packed", p.cache, bt, seq, cu, k_out, v_out, p.d)
    else:
        uq.ops.dequant_kv_packed(p.cache, bt, seq, cu, k_out, v_out)
    _check(failures, "dequant: wrote past its outputs",
           guards_intact(k_whole, k_out, 1234.0) and guards_intact(v_whole, v_out, 1234.0))
    _check(failures, "dequant: cache or guards changed", torch.equal(p.whole, p.snapshot))
    safe = torch.tensor([[b if 0 <= b < p.nb else 0 for b in r] for r in rows], dtype=torch.int32)
    rk, rv = R.dequant_kv(p.cache.cpu(), safe, torch.tensor(clamped, dtype=torch.int32))
    for b, n in enumerate(clamped):
        live = torch.tensor([0 <= rows[b][t // p.bs] < p.nb for t in range(n)], dtype=torch.bool)
        for got, ref, name in ((k_out, rk, "K"), (v_out, rv, "V")):
            want = torch.where(live[:, None, None], ref[b], torch.zeros_like(ref[b]))
            rows_got = got[int(cu[b]): int(cu[b]) + n].cpu()
            _check(failures, f"dequant {name} request {b}: differs from the surviving tokens",
                   bool(torch.allclose(rows_got, want, atol=1e-4, rtol=1e-5)))
    _flags(failures, "dequant", KernelError.BLOCK_OUT_OF_RANGE | KernelError.SEQ_LEN_OUT_OF_RANGE)


def run_all(device: str, seed: int = 0) -> list[str]:
    """Every case once on ``device``; returns what failed (empty: all held)."""
    uq.check_errors()
    failures: list[str] = []
    p = Problem(device, seed)
    for dt in (torch.int64, torch.int32):
        store_case(p, failures, dt)
    for splits in (1, 3):
        decode_case(p, failures, splits)
    prefill_case(p, failures)
    dequant_case(p, failures)
    if device != "cpu":
        torch.cuda.synchronize()
    return failures
