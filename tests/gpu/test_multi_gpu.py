"""The AOT runtime on two GPUs (issue 9): per-device modules, per-device self-test verdicts,
concurrent launches from two threads on their own streams, a tensor-parallel-like head split, and
graph capture on device 1 after warmup on device 1.

Needs two GPUs and blobs for D=128, GQA 4, block 16, bf16 ($ULTRAQUANT_GENERATED or generated/).
"""

from __future__ import annotations

import threading

import pytest
import torch

import ultraquant as uq
from ultraquant import reference as R
from ultraquant.errors import UltraQuantError
from ultraquant.kernels import workspace
from ultraquant.kernels.families import decode_splitkv as splitkv_family
from ultraquant.kernels.families import store as store_family
from ultraquant.runtime import driver, launch, loader, selftest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multi_gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two GPUs"),
]

HQ, HK, D, BS = 32, 8, 128, 16
DECODE = splitkv_family.decode_splitkv_spec(head_size=D, gqa=HQ // HK, block_size=BS, target="cuda")
STORE = store_family.store_spec(head_size=D, key_dtype="bf16", slot_dtype="i64", few_rows=False, target="cuda")
"""What the concurrency test's calls plan on an H200 (its store: 3946 tokens x 8 heads = 31568 rows,
above ``STORE_FEW_ROWS_PER_SM`` x 132 SMs)."""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    """New-process state: private verdict cache, nothing loaded, blobs only (a miss raises)."""
    monkeypatch.setenv("ULTRAQUANT_CACHE_DIR", str(tmp_path / "uqcache"))
    monkeypatch.setenv("ULTRAQUANT_BACKEND", "aot")
    loader.forget()
    launch.reset()
    a = launch.info(0).arch
    if DECODE.key() not in launch.index().entries.get(a, {}):
        pytest.skip(f"no {a} blob for {DECODE.key()}")
    yield
    launch.reset()


@pytest.fixture
def spy(monkeypatch):
    """Every driver launch as (device, function handle, torch's current device at launch)."""
    drv = driver.get_driver()
    calls: list[tuple[int, int, int]] = []
    lock = threading.Lock()
    real = drv.launch

    def launch_spy(device, function, grid, block, shared, stream, params):
        with lock:
            calls.append((device, function, torch.cuda.current_device()))
        return real(device, function, grid, block, shared, stream, params)

    monkeypatch.setattr(drv, "launch", launch_spy)
    return calls


def problem(lens: list[int], seed: int, hk: int = HK):
    """CPU tensors: raw K/V (bf16), slot mapping into a shuffled block table, a query."""
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-n // BS) for n in lens) + 2
    table, slots = R.allocate_blocks(lens, BS, nblocks, g)
    k = torch.randn(sum(lens), hk, D, generator=g).to(torch.bfloat16)
    v = torch.randn(sum(lens), hk, D, generator=g).to(torch.bfloat16)
    q = torch.randn(len(lens), hk * (HQ // HK), D, generator=g).to(torch.bfloat16)
    return dict(k=k, v=v, slots=slots, table=table, lens=torch.tensor(lens, dtype=torch.int32),
                q=q, nblocks=nblocks)


def store_and_decode(p: dict, dev: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Store then decode on ``dev`` (current stream); returns (cache, out)."""
    t = {n: x.to(f"cuda:{dev}") for n, x in p.items() if isinstance(x, torch.Tensor)}
    hk = t["k"].shape[1]
    cache = torch.zeros(p["nblocks"], BS, hk, uq.slot_size(D), dtype=torch.uint8, device=f"cuda:{dev}")
    uq.store_kv(t["k"], t["v"], cache, t["slots"])
    out = torch.full_like(t["q"], float("nan"))
    uq.decode_attention(t["q"], cache, t["table"], t["lens"], D ** -0.5, out=out)
    return cache, out


def test_two_threads_two_devices_own_streams(spy):
    p = problem([1500, 1, 333, 64, 2048], seed=1)
    results: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def worker(dev: int) -> None:
        try:
            torch.cuda.set_device(dev)
            stream = torch.cuda.Stream(dev)
            barrier.wait()
            for _ in range(10):
                with torch.cuda.stream(stream):
                    cache, out = store_and_decode(p, dev)
                stream.synchronize()
                results[dev].append((cache, out))
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for dev in (0, 1):
        cache, out = results[dev][-1]
        want = torch.zeros_like(cache)
        R.store_kv(p["k"].to(f"cuda:{dev}"), p["v"].to(f"cuda:{dev}"), want, p["slots"].to(f"cuda:{dev}"))
        lay = uq.format.SlotLayout(D)
        assert torch.equal(cache[..., lay.v_codes:], want[..., lay.v_codes:]), dev
        ref = R.decode_attention(p["q"].float().to(f"cuda:{dev}"), cache, p["table"].to(f"cuda:{dev}"),
                                 p["lens"].to(f"cuda:{dev}"), D ** -0.5)
        assert rel(out, ref) <= 1e-2, dev
        for cache_i, out_i in results[dev]:  # every iteration gave the same bytes and outputs
            assert torch.equal(cache_i, cache) and torch.equal(out_i, out)
    # Modules are per device: each launch used a function loaded on the launch's own device.
    mods = loader.loaded_modules()
    owner = {fn: dev for (dev, _), (_, fn) in mods.items()}
    assert {d for d, _, _ in spy} == {0, 1}
    assert all(owner[fn] == dev for dev, fn, _ in spy), "a function was launched on another device"
    for spec in (STORE, DECODE):
        entry = launch.index().entries[launch.info(0).arch][spec.key()]
        (m0, f0), (m1, f1) = mods[(0, entry.sha256)], mods[(1, entry.sha256)]
        assert m0 != m1 and f0 != f1
        # Verdicts are per device: one self-test per (blob, GPU), both recorded.
        v0, v1 = selftest.cached(entry, launch.info(0)), selftest.cached(entry, launch.info(1))
        assert v0 is not None and v0.ok and v1 is not None and v1.ok
    assert launch.info(0).uuid != launch.info(1).uuid


def test_launch_on_device1_from_a_thread_whose_current_device_is_0(spy):
    p = problem([400, 3], seed=2)
    torch.cuda.set_device(0)
    cache, out = store_and_decode(p, 1)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    assert spy and all(dev == 1 and cur == 0 for dev, _, cur in spy)
    ref = R.decode_attention(p["q"].float().cuda(1), cache, p["table"].cuda(1), p["lens"].cuda(1), D ** -0.5)
    assert rel(out, ref) <= 1e-2


def test_tensor_parallel_head_split_equals_single_gpu(monkeypatch):
    monkeypatch.setenv("ULTRAQUANT_DECODE_SPLITS", "4")  # same split count for 8 and 4 kv heads
    p = problem([3000, 17, 900, 1], seed=3)
    full_cache, full_out = store_and_decode(p, 0)
    torch.cuda.synchronize(0)
    half = HK // 2
    gq = HQ // HK
    outs = []
    for dev, heads in ((0, slice(0, half)), (1, slice(half, HK))):
        part = dict(p, k=p["k"][:, heads].contiguous(), v=p["v"][:, heads].contiguous(),
                    q=p["q"][:, heads.start * gq: heads.stop * gq].contiguous())
        cache, out = store_and_decode(part, dev)
        torch.cuda.synchronize(dev)
        assert torch.equal(cache.cpu(), full_cache[:, :, heads].cpu()), dev
        outs.append(out.cpu())
    assert torch.equal(torch.cat(outs, dim=1), full_out.cpu())


def test_graph_capture_on_device1_after_warmup_on_device1():
    p = problem([2500, 1, 130], seed=4)
    with torch.cuda.device(1):
        t = {n: x.cuda() for n, x in p.items() if isinstance(x, torch.Tensor)}
        cache = torch.zeros(p["nblocks"], BS, HK, uq.slot_size(D), dtype=torch.uint8, device="cuda")
        R.store_kv(t["k"], t["v"], cache, t["slots"])
        out = torch.full_like(t["q"], float("nan"))
        workspace.decode_workspace(out.device, 1 << 22, 1 << 16, 1 << 10)
        workspace.dummy_f32(out.device)
        assert launch.warmup([DECODE]) == {DECODE.key(): "aot"}
        sha = launch.index().entries[launch.info(1).arch][DECODE.key()].sha256
        assert (1, sha) in loader.loaded_modules() and (0, sha) not in loader.loaded_modules()
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            uq.decode_attention(t["q"], cache, t["table"], t["lens"], D ** -0.5, out=out)
        for new in ([2500, 1, 130], [7, 2400, 129], [1, 1, 1]):
            t["lens"].copy_(torch.tensor(new, dtype=torch.int32))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            ref = R.decode_attention(t["q"].float(), cache, t["table"], t["lens"], D ** -0.5)
            assert not out.isnan().any() and rel(out, ref) <= 1e-2, new
    # Warmup on device 1 did not warm device 0: a first use inside a capture there is refused.
    with torch.cuda.device(0):
        t0 = {n: x.cuda() for n, x in p.items() if isinstance(x, torch.Tensor)}
        cache0 = torch.zeros_like(cache, device="cuda")
        out0 = torch.full_like(t0["q"], float("nan"))
        workspace.decode_workspace(out0.device, 1 << 22, 1 << 16, 1 << 10)
        workspace.dummy_f32(out0.device)
        graph0 = torch.cuda.CUDAGraph()
        with pytest.raises(UltraQuantError, match="not loaded on cuda:0"):
            with torch.cuda.graph(graph0, stream=torch.cuda.Stream()):
                uq.decode_attention(t0["q"], cache0, t0["table"], t0["lens"], D ** -0.5, out=out0)
        torch.cuda.synchronize()
