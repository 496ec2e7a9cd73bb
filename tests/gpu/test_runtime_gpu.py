"""The AOT runtime on a real GPU (H200, sm_90 blobs), through the public ops.

* blobs launched through the ctypes loader give the same store bytes and decode/prefill/dequant
  outputs (rel <= 1e-3) as the Triton JIT run of the same kernels;
* CUDA graph capture after ``warmup`` (and a clear error without it), replay with new lengths;
* a non-default stream really is the stream the blob runs on;
* a corrupted blob and a blob whose self-test fails are refused, and the Triton path answers;
* "offline": a subprocess where ``import triton`` fails serves store + decode + prefill from blobs;
* ``compute-sanitizer --tool memcheck`` over AOT launches: 0 errors.

Needs blobs for D=128, GQA 4, block 16, bf16 (all ops and feature sets) for the GPU's arch in
``$ULTRAQUANT_GENERATED`` or generated/; skipped otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ultraquant as uq
from ultraquant import reference as R
from ultraquant.errors import UltraQuantError
from ultraquant.kernels import heuristics, specialization, workspace
from ultraquant.kernels.families import decode_splitkv as splitkv_family
from ultraquant.kernels.families import dequant as dequant_family
from ultraquant.kernels.families import store as store_family
from ultraquant.runtime import launch, loader, selftest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU"),
]

HQ, HK, D, BS = 32, 8, 128, 16
SMOKE = Path(__file__).with_name("aot_smoke.py")
FEATURES = {
    "plain": {}, "sinks+window": {"has_sinks": True, "has_window": True},
    "softcap+window": {"has_softcap": True, "has_window": True},
}
"""Three of the six built feature sets: every flag on and off (each JIT comparison compiles once)."""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.fixture(autouse=True)
def fresh_runtime(tmp_path, monkeypatch):
    """A private verdict cache per test and a fresh resolution state (modules stay loaded)."""
    monkeypatch.setenv("ULTRAQUANT_CACHE_DIR", str(tmp_path / "uqcache"))
    monkeypatch.delenv("ULTRAQUANT_REQUIRE_AOT", raising=False)
    monkeypatch.delenv("ULTRAQUANT_BACKEND", raising=False)
    launch.reset()
    yield
    launch.reset()


def decode_spec() -> specialization.Specialization:
    """The decode variant this module's calls plan on an NVIDIA GPU."""
    return splitkv_family.decode_splitkv_spec(head_size=D, gqa=HQ // HK, block_size=BS,
                                              target=specialization.target_of(torch.device("cuda")))


def store_key(encoder: str, rows: int) -> str:
    """Key of the store variant a call with ``rows`` (token, kv head) rows plans."""
    few = rows < heuristics.STORE_FEW_ROWS_PER_SM * heuristics.num_sms(torch.device("cuda"))
    return store_family.store_spec(head_size=D, key_dtype="bf16", slot_dtype="i64", encoder=encoder, few_rows=few,
                            target=specialization.target_of(torch.device("cuda"))).key()


@pytest.fixture(scope="module")
def arch() -> str:
    a = launch.info(torch.cuda.current_device()).arch
    idx = launch.index()
    need = decode_spec().key()
    if need not in idx.entries.get(a, {}):
        pytest.skip(f"no {a} blob for {need} (build them: see docs/runtime.md)")
    return a


def paged(lens: list[int], seed: int = 0):
    """A cache filled by the reference store, its shuffled block table, lens and the raw K/V."""
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-n // BS) for n in lens) + 3
    cache = torch.randint(0, 256, (nblocks, BS, HK, uq.slot_size(D)), dtype=torch.uint8, generator=g)
    table, slot_mapping = R.allocate_blocks(lens, BS, nblocks, g)
    k = torch.randn(sum(lens), HK, D, generator=g).to(torch.bfloat16)
    v = torch.randn(sum(lens), HK, D, generator=g).to(torch.bfloat16)
    cache, table, k, v, slot_mapping = (t.cuda() for t in (cache, table, k, v, slot_mapping))
    R.store_kv(k, v, cache, slot_mapping)
    return cache, table, torch.tensor(lens, dtype=torch.int32, device="cuda"), k, v, slot_mapping


def options(feat: dict, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    sinks = torch.randn(HQ, generator=g).cuda() if feat.get("has_sinks") else None
    return sinks, (300 if feat.get("has_window") else None), (30.0 if feat.get("has_softcap") else None)


def run_both(monkeypatch, fn):
    """``fn()`` under ULTRAQUANT_BACKEND=aot (a miss raises) and under =triton; returns both results."""
    monkeypatch.setenv("ULTRAQUANT_BACKEND", "aot")
    a = fn()
    torch.cuda.synchronize()
    monkeypatch.setenv("ULTRAQUANT_BACKEND", "triton")
    b = fn()
    torch.cuda.synchronize()
    monkeypatch.delenv("ULTRAQUANT_BACKEND")
    return a, b


def launched_keys() -> set[str]:
    return {k for (_, k), st in launch.state().items() if isinstance(st, loader.Kernel)}


# --- same results as the JIT --------------------------------------------------------------------------

@pytest.mark.parametrize("encoder", ["rne", "upstream", "mse"])
def test_store_bytes_equal_jit(arch, monkeypatch, encoder):
    n = 1000
    g = torch.Generator().manual_seed(7)
    key = torch.randn(n, HK, D, generator=g).to(torch.bfloat16).cuda()
    value = torch.randn(n, HK, D, generator=g).to(torch.bfloat16).cuda()
    nblocks = n // BS + 4
    slots = torch.randperm(nblocks * BS, generator=g)[:n]
    slots[::97] = -1
    slots = slots.cuda()
    poison = torch.randint(0, 256, (nblocks, BS, HK, uq.slot_size(D)), dtype=torch.uint8, generator=g).cuda()

    def store():
        c = poison.clone()
        uq.store_kv(key, value, c, slots, encoder=encoder)
        return c

    aot, jit = run_both(monkeypatch, store)
    assert store_key(encoder, key.shape[0] * HK) in launched_keys()
    assert torch.equal(aot, jit)


@pytest.mark.parametrize("feature", list(FEATURES))
def test_decode_equals_jit(arch, monkeypatch, feature):
    lens = [1, 17, 2047, 2048, 700, 33, 4000, 5]
    cache, table, seq_lens, _, _, _ = paged(lens, seed=len(feature))
    query = torch.randn(len(lens), HQ, D, device="cuda", dtype=torch.bfloat16)
    sinks, window, softcap = options(FEATURES[feature])

    def decode():
        out = torch.full_like(query, float("nan"))
        uq.decode_attention(query, cache, table, seq_lens, D ** -0.5, sinks=sinks, sliding_window=window,
                            softcap=softcap, out=out)
        return out

    aot, jit = run_both(monkeypatch, decode)
    assert not aot.isnan().any()
    assert rel(aot, jit) <= 1e-3
    ref = R.decode_attention(query.float(), cache, table, seq_lens, D ** -0.5, sinks=sinks,
                             sliding_window=window, softcap=softcap)
    assert rel(aot, ref) <= 1e-2


@pytest.mark.parametrize("feature", ["plain", "softcap+window"])
def test_prefill_equals_jit(arch, monkeypatch, feature):
    lens, q_lens = [900, 60, 130], [12, 60, 1]
    cache, table, seq_lens, k, v, _ = paged(lens, seed=3)
    ends = torch.tensor(lens).cumsum(0)
    rows = torch.cat([torch.arange(int(e) - q, int(e)) for e, q in zip(ends, q_lens, strict=True)]).cuda()
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    query = torch.randn(sum(q_lens), HQ, D, device="cuda", dtype=torch.bfloat16)
    key, value = k[rows].contiguous(), v[rows].contiguous()
    sinks, window, softcap = options(FEATURES[feature])

    def prefill():
        out = torch.full_like(query, float("nan"))
        uq.prefill_attention(query, key, value, cache, table, seq_lens, qsl, D ** -0.5, sinks=sinks,
                             sliding_window=window, softcap=softcap, out=out)
        return out

    aot, jit = run_both(monkeypatch, prefill)
    assert not aot.isnan().any()
    assert rel(aot, jit) <= 1e-3


@pytest.mark.parametrize("original_space", [True, False])
def test_dequant_equals_jit(arch, monkeypatch, original_space):
    key = dequant_family.dequant_spec(head_size=D, block_size=BS, original_space=original_space).key()
    if key not in launch.index().entries[arch]:
        pytest.skip(f"{key} is not built")
    out_dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[
        launch.index().entries[arch][key].signature["k_out_ptr"].lstrip("*")])
    lens = [300, 1, 64]
    cache, table, seq_lens, _, _, _ = paged(lens, seed=5)
    cu = torch.tensor([0, 300, 301, 365], dtype=torch.int32, device="cuda")

    def dequant():
        k = torch.full((365, HK, D), float("nan"), device="cuda", dtype=out_dtype)
        v = torch.full_like(k, float("nan"))
        uq.ops.dequant_kv_packed(cache, table, seq_lens, cu, k, v, original_space=original_space)
        return torch.cat([k, v])

    aot, jit = run_both(monkeypatch, dequant)
    assert not aot.isnan().any() and rel(aot, jit) <= 1e-3


# --- graphs and streams ---------------------------------------------------------------------------------

def test_graph_capture_after_warmup_and_replay_new_lengths(arch, monkeypatch):
    lens = [3000, 1, 250, 64]
    cache, table, seq_lens, _, _, _ = paged(lens, seed=11)
    query = torch.randn(len(lens), HQ, D, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(query, float("nan"))
    monkeypatch.setenv("ULTRAQUANT_BACKEND", "aot")
    spec = decode_spec()
    stream = torch.cuda.Stream()
    # Without warmup the first use happens inside the capture: a clear error, not a broken graph.
    graph = torch.cuda.CUDAGraph()
    workspace.decode_workspace(query.device, 1 << 22, 1 << 16, 1 << 10)  # allocate before any capture
    workspace.dummy_f32(query.device)
    with pytest.raises(UltraQuantError, match="warmup"):
        with torch.cuda.graph(graph, stream=stream):
            uq.decode_attention(query, cache, table, seq_lens, D ** -0.5, out=out)
    torch.cuda.synchronize()
    assert launch.warmup([spec]) == {spec.key(): "aot"}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        uq.decode_attention(query, cache, table, seq_lens, D ** -0.5, out=out)
    # New lengths stay within each request's stored tokens: the rest of the cache is random poison.
    for new in ([3000, 1, 250, 64], [17, 1, 0, 64], [2999, 1, 249, 1], [1, 1, 1, 1]):
        seq_lens.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = R.decode_attention(query.float(), cache, table, seq_lens, D ** -0.5)
        assert not out.isnan().any() and rel(out, ref) <= 1e-2, new


def test_documented_warmup_then_capture_with_no_eager_call(arch, monkeypatch):
    """Issue 17, item 6: ``ultraquant.warmup([model config])`` loads what a decode step plans (the
    few-rows store, the FP4_PTX decode), so a capture right after it, under REQUIRE_AOT=1, works."""
    monkeypatch.setenv("ULTRAQUANT_REQUIRE_AOT", "1")
    model = {"head_size": D, "num_q_heads": HQ, "num_kv_heads": HK, "block_size": BS, "dtype": "bf16",
             "ops": ["store_kv", "decode_attention"]}
    report = uq.warmup([model])
    assert set(report.values()) == {"aot"} and store_key("rne", 2 * HK) in report and decode_spec().key() in report
    lens = [300, 17]
    cache, table, seq_lens, _, _, _ = paged(lens, seed=21)
    g = torch.Generator().manual_seed(22)
    k_new, v_new = (torch.randn(2, HK, D, generator=g).to(torch.bfloat16).cuda() for _ in range(2))
    query = torch.randn(2, HQ, D, generator=g).to(torch.bfloat16).cuda()
    tab = table.cpu()
    slots = torch.tensor([int(tab[i, n // BS]) * BS + n % BS for i, n in enumerate(lens)], device="cuda")
    new_lens = seq_lens + 1
    want_cache = cache.clone()
    R.store_kv(k_new, v_new, want_cache, slots)
    out = torch.full_like(query, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        uq.store_kv(k_new, v_new, cache, slots)
        uq.decode_attention(query, cache, table, new_lens, D ** -0.5, out=out)
    graph.replay()
    torch.cuda.synchronize()
    lay = uq.format.SlotLayout(D)
    assert torch.equal(cache[..., lay.v_codes:], want_cache[..., lay.v_codes:])
    ref = R.decode_attention(query.float(), want_cache, table, new_lens, D ** -0.5)
    assert not out.isnan().any() and rel(out, ref) <= 1e-2
    assert {store_key("rne", 2 * HK), decode_spec().key()} <= launched_keys()


def test_launches_go_to_the_current_stream(arch, monkeypatch):
    lens = [500, 20]
    cache, table, seq_lens, _, _, _ = paged(lens, seed=13)
    query = torch.randn(len(lens), HQ, D, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(query, float("nan"))
    monkeypatch.setenv("ULTRAQUANT_BACKEND", "aot")
    uq.decode_attention(query, cache, table, seq_lens, D ** -0.5, out=out)  # load + self-test first
    out.fill_(float("nan"))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keep the side stream busy for a while
        uq.decode_attention(query, cache, table, seq_lens, D ** -0.5, out=out)
    torch.cuda.current_stream().synchronize()
    # Had the blob gone to the default stream, it would have run by now.
    assert not side.query() and out.isnan().all()
    side.synchronize()
    ref = R.decode_attention(query.float(), cache, table, seq_lens, D ** -0.5)
    assert rel(out, ref) <= 1e-2


# --- refusals: the Triton path answers --------------------------------------------------------------

def _copy_manifest(tmp_path: Path, arch: str) -> Path:
    src = launch.index()._manifests
    m = next(m for m in src if m.arch == arch)
    dst = tmp_path / "gen" / arch
    shutil.copytree(m.directory, dst)
    return dst


def _entry(data: dict, key: str) -> dict:
    return next(b for b in data["blobs"] if b["key"] == key)


def test_corrupted_blob_is_refused_and_triton_answers(arch, tmp_path, monkeypatch, caplog):
    d = _copy_manifest(tmp_path, arch)
    data = json.loads((d / "manifest.json").read_text())
    key = decode_spec().key()
    blob = d / _entry(data, key)["file"]
    raw = bytearray(blob.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    blob.write_bytes(bytes(raw))
    monkeypatch.setenv("ULTRAQUANT_GENERATED", str(tmp_path / "gen"))
    loader.forget()  # as a new process: nothing verified or loaded yet
    launch.reset()
    caplog.set_level(logging.WARNING, logger="ultraquant.runtime")
    cache, table, seq_lens, _, _, _ = paged([100, 9], seed=2)
    query = torch.randn(2, HQ, D, device="cuda", dtype=torch.bfloat16)
    out = uq.decode_attention(query, cache, table, seq_lens, D ** -0.5)
    ref = R.decode_attention(query.float(), cache, table, seq_lens, D ** -0.5)
    assert rel(out, ref) <= 1e-2
    st = launch.state()[(torch.cuda.current_device(), key)]
    assert isinstance(st, launch.Miss) and "sha256" in st.reason
    assert any("corrupted" in r.getMessage() for r in caplog.records)


def test_blob_failing_its_selftest_is_disabled_and_triton_answers(arch, tmp_path, monkeypatch, caplog):
    d = _copy_manifest(tmp_path, arch)
    data = json.loads((d / "manifest.json").read_text())
    rne, ups = store_key("rne", 200 * HK), store_key("upstream", 200 * HK)
    a, b = _entry(data, rne), _entry(data, ups)
    a["file"], a["sha256"] = b["file"], b["sha256"]  # the rne key now holds the upstream kernel
    (d / "manifest.json").write_text(json.dumps(data))
    monkeypatch.setenv("ULTRAQUANT_GENERATED", str(tmp_path / "gen"))
    loader.forget()
    launch.reset()
    caplog.set_level(logging.WARNING, logger="ultraquant.runtime")
    _, _, _, k, v, slots = paged([200], seed=4)
    v[0, 0, :8] = torch.tensor([6.0, 0.75, 1.75, 2.5, 3.5, 5.0, 0.25, 1.25], dtype=torch.bfloat16)
    got = torch.zeros(int(slots.max()) // BS + 1, BS, HK, uq.slot_size(D), dtype=torch.uint8, device="cuda")
    want = torch.zeros_like(got)
    # Issue 17 item 5: the upstream blob first passes its self-test under its own key; that verdict
    # must not carry over to the rne key pointing at the same bytes.
    uq.store_kv(k, v, torch.zeros_like(got), slots, encoder="upstream")
    assert isinstance(launch.state()[(torch.cuda.current_device(), ups)], loader.Kernel)
    uq.store_kv(k, v, got, slots)
    R.store_kv(k, v, want, slots)
    torch.cuda.synchronize()
    lay = uq.format.SlotLayout(D)
    assert torch.equal(got[..., lay.v_codes:], want[..., lay.v_codes:])  # rne bytes: Triton answered
    st = launch.state()[(torch.cuda.current_device(), rne)]
    assert isinstance(st, launch.Miss) and "self-test failed" in st.reason and "V/untouched" in st.reason
    dev = launch.info(torch.cuda.current_device())
    verdict = selftest.cached(launch.index().entries[dev.arch][rne], dev)
    assert verdict is not None and not verdict.ok


# --- offline and memcheck -------------------------------------------------------------------------------

def test_offline_without_triton_serves_from_blobs(arch):
    env = dict(os.environ)
    r = subprocess.run([sys.executable, str(SMOKE), "--no-triton"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "AOT-SMOKE OK" in r.stdout and "triton-imported=False" in r.stdout, r.stdout


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not on PATH")
def test_memcheck_over_aot_launches(arch):
    # No caching allocator: an out-of-bounds access into a neighbouring tensor is caught too.
    # Self-tests off here: they run the reference's many torch kernels, not our launches.
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1", "ULTRAQUANT_SELFTEST": "0"}
    r = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--print-limit", "20", sys.executable,
                        str(SMOKE), "--no-triton"], env=env, capture_output=True, text=True, timeout=540)
    text = r.stdout + r.stderr
    print(text[-2000:])
    assert "AOT-SMOKE OK" in text and "ERROR SUMMARY: 0 errors" in text, text[-4000:]
