"""A mini serving simulation of UltraQuantAttention: the layer as a paged serving engine drives it.

Many requests with random prompt and generation lengths; each step a scheduler spends a token budget
on running decodes first and then on prefill chunks (chunked prefill, new requests admitted when
blocks allow), allocates cache blocks from a shuffled free list, frees them when a request finishes
(so later requests reuse blocks that hold stale bytes), pads the batch with skipped tokens, and runs
one forward on the mixed batch. Every step's output is compared with an oracle that keeps each
request's unquantized K/V history and applies the same quantize-dequantize (ultraquant.reference)
to what the cache holds: decode rows read everything from the cache (their own token included);
prefill rows read the cached prefix and their chunk's raw K/V.

The engine (``Simulation``) is device-agnostic; tests/gpu/test_attention_gpu.py runs it on the H200.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

import ultraquant
from ultraquant import ops, reference
from ultraquant.attention import AttentionMetadata, UltraQuantAttention
from ultraquant.format import slot_size


@dataclass
class Request:
    """One request: its whole K/V history is drawn up front (the "model" is random data)."""

    rid: int
    prompt_len: int
    gen_len: int
    k: torch.Tensor  # (total, Hk, D) in the serving dtype, on the CPU
    v: torch.Tensor
    kq: torch.Tensor  # float64: what the cache returns for each token (fake-quantized K and V)
    vq: torch.Tensor
    computed: int = 0  # tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.prompt_len + self.gen_len

    @property
    def done(self) -> bool:
        return self.computed >= self.total


def fake_quant(k: torch.Tensor, v: torch.Tensor, encoder: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What the cache gives back for K (rotated on the way in, un-rotated on the way out) and V."""
    kc, ks = reference.quantize(k, rotate=True, encoder=encoder)
    vc, vs = reference.quantize(v, rotate=False, encoder=encoder)
    return (reference.dequantize(kc, ks, rotate=True, dtype=torch.float64),
            reference.dequantize(vc, vs, rotate=False, dtype=torch.float64))


def oracle_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
                     sinks: torch.Tensor | None, window: int | None, softcap: float | None) -> torch.Tensor:
    """Plain float64 softmax attention (M, Hq, D) x (L, Hk, D): causal by absolute position."""
    hq, hk = q.shape[1], k.shape[1]
    g = hq // hk
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(hq):
        s = (q[:, h].double() @ k[:, h // g].double().T) * scale  # (M, L)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        kp = torch.arange(k.shape[0])
        mask = kp[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= kp[None, :] > q_pos[:, None] - window
        s = s.masked_fill(~mask, -math.inf)
        extra = sinks[h].double().expand(s.shape[0], 1) if sinks is not None else None
        full = torch.cat([s, extra], 1) if extra is not None else s
        m = full.max(dim=1, keepdim=True).values
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(full - m)
        den = p.sum(dim=1, keepdim=True)
        p = torch.where(den > 0, p / den, torch.zeros_like(p))
        out[:, h] = p[:, : k.shape[0]] @ v[:, h // g].double()
    return out


@dataclass
class SimConfig:
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 64
    block_size: int = 4
    num_blocks: int = 40
    num_requests: int = 10
    max_prompt: int = 30
    max_gen: int = 6
    token_budget: int = 16
    max_running: int = 6
    padding_tokens: int = 3
    threshold: int = 3
    head_major: bool = False
    dtype: torch.dtype = torch.float32
    sinks: bool = False
    window: int | None = None
    softcap: float | None = None
    encoder: str = "rne"
    seed: int = 0
    check_cache_every: int = 7
    cache_mismatch_frac: float = 0.0


class Simulation:
    """The engine: scheduler, block manager, cache, layer and oracle (see the module docstring)."""

    def __init__(self, cfg: SimConfig, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.rng = random.Random(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        hk, d = cfg.num_kv_heads, cfg.head_size
        sb = slot_size(d)
        if cfg.head_major:  # (num_blocks, Hk, block_size, slot) memory, seen as (nb, bs, Hk, slot)
            buf = torch.zeros(cfg.num_blocks, hk, cfg.block_size, sb, dtype=torch.uint8, device=self.device)
            self.kv_cache = buf.permute(0, 2, 1, 3)
        else:
            self.kv_cache = torch.zeros(cfg.num_blocks, cfg.block_size, hk, sb, dtype=torch.uint8,
                                        device=self.device)
        # Stale bytes everywhere: a reused block must never leak into a result.
        self.kv_cache.copy_(torch.randint(0, 256, self.kv_cache.shape, generator=self.gen, dtype=torch.uint8))
        self.sinks = (torch.randn(cfg.num_heads, generator=self.gen) * 2) if cfg.sinks else None
        self.scale = d ** -0.5
        self.layer = UltraQuantAttention(
            cfg.num_heads, hk, d, self.scale, sinks=self.sinks, sliding_window=cfg.window,
            softcap=cfg.softcap, encoder=cfg.encoder, continuation_threshold=cfg.threshold)
        self.layer.setup(self.device, max_num_reqs=cfg.max_running + 1)
        self.free = list(range(cfg.num_blocks))
        self.rng.shuffle(self.free)
        self.reserved = 0
        self.owners: dict[int, set[int]] = {}
        self.waiting = [self._new_request(i) for i in range(cfg.num_requests)]
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.stats: Counter[str] = Counter()
        self.max_err = 0.0
        self.min_cos = 1.0

    def _new_request(self, rid: int) -> Request:
        cfg = self.cfg
        p = self.rng.randint(1, cfg.max_prompt)
        g = self.rng.randint(1, cfg.max_gen)
        shape = (p + g, cfg.num_kv_heads, cfg.head_size)
        k = (torch.randn(shape, generator=self.gen) * 1.5).to(cfg.dtype)
        v = torch.randn(shape, generator=self.gen).to(cfg.dtype)
        kq, vq = fake_quant(k, v, cfg.encoder)
        return Request(rid, p, g, k, v, kq, vq)

    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.cfg.block_size)

    def _grow(self, r: Request, upto: int) -> None:
        while len(r.blocks) < self._blocks_for(upto):
            b = self.free.pop()
            self.owners.setdefault(b, set()).add(r.rid)
            r.blocks.append(b)

    def _release(self, r: Request) -> None:
        self.free.extend(r.blocks)
        self.reserved -= self._blocks_for(r.total)
        r.blocks = []
        self.rng.shuffle(self.free)

    def schedule(self) -> list[tuple[Request, int]]:
        """(request, new tokens) pairs, decodes (one token) first, within the token budget."""
        cfg = self.cfg
        budget = cfg.token_budget
        batch: list[tuple[Request, int]] = []
        for r in self.running:
            if r.computed >= r.prompt_len and budget > 0:
                batch.append((r, 1))
                budget -= 1
        while self.waiting and len(self.running) < cfg.max_running:
            need = self._blocks_for(self.waiting[0].total)
            if self.reserved + need > cfg.num_blocks:
                break
            self.reserved += need
            self.running.append(self.waiting.pop(0))
        for r in self.running:
            if r.computed < r.prompt_len and budget > 0:
                # Random chunk caps stand in for competing requests: chunks of every size occur.
                n = min(r.prompt_len - r.computed, budget, self.rng.randint(1, cfg.token_budget))
                batch.append((r, n))
                budget -= n
        # vLLM's reorder: one-token requests (decodes, and one-token chunks) lead the batch.
        batch.sort(key=lambda x: 0 if x[1] == 1 else 1)
        return batch

    def step(self) -> bool:
        """Schedule, run one forward, compare with the oracle; False when every request is done."""
        batch = self.schedule()
        if not batch:
            return False
        self.run_batch(batch)
        self.stats["steps"] += 1
        if self.cfg.check_cache_every and self.stats["steps"] % self.cfg.check_cache_every == 0:
            self.check_cache()
        for r in [r for r in self.running if r.done]:
            self.running.remove(r)
            self._release(r)
            self.finished.append(r)
        return True

    def run_batch(self, batch: list[tuple[Request, int]]) -> None:
        """One eager forward over ``batch`` (one-token requests first), checked against the oracle;
        the requests advance by their new tokens."""
        cfg = self.cfg
        hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_size
        q_lens, seq_lens, tables, slots = [], [], [], []
        keys, values = [], []
        for r, n in batch:
            self._grow(r, r.computed + n)
            pos = torch.arange(r.computed, r.computed + n)
            q_lens.append(n)
            seq_lens.append(r.computed + n)
            tables.append(r.blocks)
            blocks = torch.tensor(r.blocks)[pos // cfg.block_size]
            slots.append(blocks * cfg.block_size + pos % cfg.block_size)
            keys.append(r.k[r.computed:r.computed + n])
            values.append(r.v[r.computed:r.computed + n])
        n_tok = sum(q_lens)
        pad = cfg.padding_tokens
        md = AttentionMetadata.build(query_lens=q_lens, seq_lens=seq_lens, block_table=tables,
                                     slot_mapping=torch.cat(slots), device=self.device,
                                     num_padding_tokens=pad)
        query = (torch.randn(n_tok + pad, hq, d, generator=self.gen)).to(cfg.dtype)
        key = torch.cat(keys + [torch.randn(pad, hk, d, generator=self.gen).to(cfg.dtype)])
        value = torch.cat(values + [torch.randn(pad, hk, d, generator=self.gen).to(cfg.dtype)])
        out = torch.full((n_tok + pad, hq * d), float("nan"), dtype=cfg.dtype, device=self.device)
        self.forward_batch(query.to(self.device).reshape(n_tok + pad, hq * d), key.to(self.device),
                           value.to(self.device), md, out)
        got = out.view(n_tok + pad, hq, d).cpu()
        assert torch.isnan(got[n_tok:]).all(), "padding rows of out must stay untouched"
        expect = self.oracle(batch, query, md.num_decodes)
        self.compare(got[:n_tok], expect)
        self.stats["decode_rows"] += md.num_decodes
        self.stats["prefill_rows"] += len(batch) - md.num_decodes
        if md.num_decodes and md.num_decodes < len(batch):
            self.stats["mixed_steps"] += 1
        for r, n in batch:
            r.computed += n

    def forward_batch(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      md: AttentionMetadata, out: torch.Tensor) -> None:
        """How the engine calls the layer (tests/test_vllm_adapter.py drives vLLM's classes here)."""
        self.layer.forward(query, key, value, self.kv_cache, md, out)

    def oracle(self, batch: list[tuple[Request, int]], query: torch.Tensor, num_decodes: int) -> torch.Tensor:
        """Expected (N, Hq, D) float64 from the unquantized histories (see the module docstring)."""
        rows = []
        t = 0
        for i, (r, n) in enumerate(batch):
            ctx, end = r.computed, r.computed + n
            if i < num_decodes or self._chunk_from_cache(ctx, n, query):
                # decode rows (and small continuations on the multi-query decode) read their own
                # (quantized) tokens from the cache too
                k, v = r.kq[:end], r.vq[:end]
                self.stats["chunks_from_cache"] += int(i >= num_decodes)
            else:
                k = torch.cat([r.kq[:ctx], r.k[ctx:end].double()])
                v = torch.cat([r.vq[:ctx], r.v[ctx:end].double()])
            rows.append(oracle_attention(query[t:t + n].double(), k, v, torch.arange(ctx, end), self.scale,
                                         self.sinks, self.cfg.window, self.cfg.softcap))
            t += n
        return torch.cat(rows)

    def _chunk_from_cache(self, ctx: int, n: int, query: torch.Tensor) -> bool:
        """Whether the layer serves this continuation by the multi-query decode (its K/V read back from
        the cache): a small one (every small run is then <= 16 tokens) where the kernel covers the layer.
        The rule is asked about a query row on the layer's device (``query`` is the oracle's CPU copy: on
        the CPU the rule always says no)."""
        return (0 < ctx and n <= self.layer.threshold <= 16
                and ops.spec_decode_takes_kernel(query[:1].to(self.device), self.kv_cache, self.layer.threshold))

    def compare(self, got: torch.Tensor, expect: torch.Tensor) -> None:
        """Per-element error relative to the output scale, and the per-row cosine."""
        g = got.double()
        assert torch.isfinite(g).all()
        scale = expect.abs().amax().clamp_min(1e-6)
        err = float((g - expect).abs().amax() / scale)
        a, b = g.reshape(-1, g.shape[-1]), expect.reshape(-1, expect.shape[-1])
        live = b.norm(dim=-1) > 1e-9
        cos = torch.nn.functional.cosine_similarity(a[live], b[live], dim=-1)
        self.max_err = max(self.max_err, err)
        if cos.numel():
            self.min_cos = min(self.min_cos, float(cos.min()))

    def check_cache(self) -> None:
        """The cache holds exactly the fake-quantized history of every running request."""
        live = [r for r in self.running if r.computed and r.blocks]
        if not live:
            return
        width = max(len(r.blocks) for r in live)
        bt = torch.zeros(len(live), width, dtype=torch.int32)
        for i, r in enumerate(live):
            bt[i, :len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        lens = torch.tensor([r.computed for r in live], dtype=torch.int32)
        ks, vs = ultraquant.dequant_kv(self.kv_cache, bt.to(self.device), lens.to(self.device))
        h = ultraquant.hadamard(self.cfg.head_size, dtype=torch.float64)
        for r, k, v in zip(live, ks, vs, strict=True):
            # K is compared in the rotated space where it is quantized: a GPU store may round a rare
            # near-tie element one step differently (kernels issue), and un-rotated that one element
            # would smear over the whole head vector.
            for got, want in ((k.cpu().double() @ h, r.kq[:r.computed] @ h), (v.cpu().double(), r.vq[:r.computed])):
                bad = ~torch.isclose(got, want, atol=1e-4, rtol=1e-4)
                assert float(bad.double().mean()) <= self.cfg.cache_mismatch_frac, (r.rid, int(bad.sum()))
        self.stats["cache_checks"] += 1

    def run(self, max_steps: int = 500) -> Simulation:
        while self.step():
            assert self.stats["steps"] < max_steps, "the simulation does not finish"
        assert not self.waiting and not self.running
        assert sorted(self.free) == list(range(self.cfg.num_blocks)), "blocks leaked"
        return self

    @property
    def reused_blocks(self) -> int:
        """Blocks that served more than one request."""
        return sum(1 for owners in self.owners.values() if len(owners) > 1)


def decode_replay_run(cfg: SimConfig, device: str, use_graph: bool, b: int = 8, steps: int = 40) -> Simulation:
    """Decode steps of ``b`` requests through one captured forward (tests/gpu: a CUDA graph
    captured once and replayed). Between replays only the static buffers' contents change: new
    queries and K/V, growing seq_lens, new blocks from the free list written into the block table
    when a sequence crosses a block boundary, and finished requests turned into padding rows
    (seq_len 0, slot -1, output zeros) whose blocks go to the end of the free list, so the next new
    block reuses one. ``use_graph=False`` calls the forward instead of replaying (any device)."""
    s = Simulation(cfg, device)
    rng = random.Random(cfg.seed + 1)
    reqs = []
    for i in range(b):
        r = s._new_request(i)
        gen = rng.randint(steps // 4, steps // 2) if i % 3 == 0 else steps  # some finish early
        r = Request(r.rid, r.prompt_len, gen, r.k[: r.prompt_len], r.v[: r.prompt_len], r.kq, r.vq)
        reqs.append(r)
    # Histories long enough for the decode steps.
    g = torch.Generator().manual_seed(cfg.seed + 2)
    for r in reqs:
        extra = (r.total - r.k.shape[0], cfg.num_kv_heads, cfg.head_size)
        r.k = torch.cat([r.k, torch.randn(extra, generator=g).to(cfg.dtype)])
        r.v = torch.cat([r.v, torch.randn(extra, generator=g).to(cfg.dtype)])
        r.kq, r.vq = fake_quant(r.k, r.v, cfg.encoder)
    s.running = list(reqs)
    s.run_batch([(r, r.prompt_len) for r in reqs])  # eager prefill of every prompt (first chunks)
    width = s._blocks_for(cfg.max_prompt + steps)
    dev = torch.device(device)
    hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_size
    q_s = torch.zeros(b, hq, d, dtype=cfg.dtype, device=dev)
    k_s = torch.zeros(b, hk, d, dtype=cfg.dtype, device=dev)
    v_s = torch.zeros(b, hk, d, dtype=cfg.dtype, device=dev)
    slot_s = torch.full((b,), -1, dtype=torch.int64, device=dev)
    seq_s = torch.zeros(b, dtype=torch.int32, device=dev)
    bt_s = torch.zeros(b, width, dtype=torch.int32, device=dev)
    out_s = torch.zeros(b, hq * d, dtype=cfg.dtype, device=dev)
    md = AttentionMetadata(seq_lens=seq_s, query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=dev),
                           block_table=bt_s, slot_mapping=slot_s, num_actual_tokens=b, num_decodes=b,
                           max_query_len=1, max_seq_len=width * cfg.block_size)

    def fill() -> torch.Tensor:
        """Next decode token of every live request into the static buffers; the queries used."""
        q = torch.randn(b, hq, d, generator=g).to(cfg.dtype)
        slots = torch.full((b,), -1, dtype=torch.int64)
        lens = torch.zeros(b, dtype=torch.int32)
        k = torch.zeros(b, hk, d, dtype=cfg.dtype)
        v = torch.zeros(b, hk, d, dtype=cfg.dtype)
        table = torch.zeros(b, width, dtype=torch.int32)
        for i, r in enumerate(reqs):
            if r.done:
                continue
            s._grow(r, r.computed + 1)
            p = r.computed
            slots[i] = r.blocks[p // cfg.block_size] * cfg.block_size + p % cfg.block_size
            lens[i] = p + 1
            k[i], v[i] = r.k[p], r.v[p]
            table[i, : len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        for dst, src in ((q_s, q), (k_s, k), (v_s, v), (slot_s, slots), (seq_s, lens), (bt_s, table)):
            dst.copy_(src)
        return q

    def forward() -> None:
        s.layer.forward(q_s, k_s, v_s, s.kv_cache, md, out_s)

    q = fill()
    replay = forward
    if use_graph:
        n_warm = s.layer.warmup_decode(s.kv_cache, max_num_reqs=b, max_seq_len=width * cfg.block_size,
                                       dtype=cfg.dtype)
        assert n_warm in (0, b)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: sizes every workspace before capture
            forward()
            forward()  # the same token stored twice: same bytes
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        replay = graph.replay
    replays = 0
    while any(not r.done for r in reqs):
        if replays:
            q = fill()
        out_s.fill_(float("nan"))
        replay()
        got = out_s.view(b, hq, d).cpu()
        live = [(i, r) for i, r in enumerate(reqs) if not r.done]
        expect = s.oracle([(r, 1) for _, r in live], q[[i for i, _ in live]], len(live))
        s.compare(got[[i for i, _ in live]], expect)
        dead = [i for i, r in enumerate(reqs) if r.done]
        if dead:
            assert not got[dead].any(), "a padding row (seq_len 0) must come out as zeros"
        for _, r in live:
            r.computed += 1
            if r.done:  # freed blocks go to the end of the free list: the next new block reuses one
                s.free.extend(r.blocks)
                r.blocks = []
        replays += 1
        if replays % max(1, steps // 4) == 0:
            s.check_cache()
    if use_graph:
        torch.cuda.synchronize()
    assert replays == steps
    assert s.reused_blocks > 0, "no block was reused under the graph"
    assert s.stats["cache_checks"] > 0
    return s


CASES = {
    "fp32": SimConfig(),
    "bf16-headmajor-sinks-window-softcap": SimConfig(
        dtype=torch.bfloat16, head_major=True, sinks=True, window=9, softcap=8.0, seed=1,
        num_heads=8, num_kv_heads=2, block_size=8, num_blocks=24, threshold=5),
    "upstream-encoder-gqa1": SimConfig(num_heads=2, num_kv_heads=2, head_size=32, encoder="upstream",
                                       seed=2, num_requests=8, token_budget=10),
}


@pytest.mark.parametrize("name", list(CASES))
def test_serving_simulation_cpu(name: str) -> None:
    cfg = CASES[name]
    sim = Simulation(cfg).run()
    # The run must have exercised what it claims to test.
    assert len(sim.finished) == cfg.num_requests
    assert sim.stats["mixed_steps"] > 0
    assert sim.reused_blocks > 0
    assert sim.stats["cache_checks"] > 0
    routes = sim.layer.route_counts
    for kind in ("store", "decode", "first", "small", "large"):
        assert routes[kind] > 0, (kind, dict(routes))
    # CPU runs the reference ops (float64 inside): only the output dtype's rounding remains.
    tol = 1e-5 if cfg.dtype == torch.float32 else 1e-2
    assert sim.max_err <= tol, sim.max_err
    assert sim.min_cos >= 1 - tol, sim.min_cos


def test_serving_simulation_with_the_multiquery_route(monkeypatch) -> None:
    """Small continuations on the multi-query route (forced on the CPU: the reference spec-decode, their
    own K/V read back from the cache): the oracle follows the route, at the reference's precision; and the
    oracle of the raw-K/V route is measurably off there (so the route is really taken)."""
    monkeypatch.setattr(ops, "spec_decode_takes_kernel", lambda q, c, m: m <= 16)
    cfg = SimConfig(seed=4, threshold=5)
    sim = Simulation(cfg).run()
    assert sim.layer.prefill_routes["small:multiquery"] > 0, dict(sim.layer.prefill_routes)
    assert sim.stats["chunks_from_cache"] > 0, dict(sim.stats)
    assert sim.max_err <= 1e-5 and sim.min_cos >= 1 - 1e-5, (sim.max_err, sim.min_cos)
    monkeypatch.setattr(Simulation, "_chunk_from_cache", lambda self, ctx, n, query: False)
    wrong = Simulation(cfg).run()
    assert wrong.max_err > 1e-4, wrong.max_err


def test_oracle_detects_a_wrong_cache() -> None:
    """The comparison can fail: corrupting one cached block changes the outputs beyond tolerance."""
    sim = Simulation(SimConfig(num_requests=2, max_gen=4, seed=3, check_cache_every=0))
    while sim.step():
        live = [r for r in sim.running if r.computed > sim.cfg.block_size and not r.done]
        if live and sim.stats["steps"] > 2:
            blk = live[0].blocks[0]
            sim.kv_cache[blk] = 0x77
            sim.max_err = 0.0
            sim.step()
            assert sim.max_err > 1e-2
            return
    pytest.fail("no request grew past one block")


@pytest.mark.parametrize("head_major", [False, True])
def test_decode_replay_bookkeeping_cpu(head_major: bool) -> None:
    """The GPU graph test's engine without the graph: decode-only batches over static buffers."""
    cfg = SimConfig(block_size=4, num_blocks=48, max_prompt=12, head_major=head_major, padding_tokens=0,
                    seed=5)
    s = decode_replay_run(cfg, "cpu", use_graph=False, b=4, steps=12)
    assert s.max_err <= 1e-5 and s.min_cos >= 1 - 1e-5
    assert s.layer.route_counts["decode"] >= 12  # one per replayed step


_INTERPRETER_RUN = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("uq_sim", sys.argv[1])
m = importlib.util.module_from_spec(spec); sys.modules["uq_sim"] = m; spec.loader.exec_module(m)
import torch
cfg = m.SimConfig(num_requests=4, max_prompt=12, max_gen=3, token_budget=8, threshold=2, head_major=True,
                  sinks=True, window=6, softcap=8.0, dtype=torch.bfloat16, check_cache_every=3,
                  cache_mismatch_frac=1e-3, seed=7)
s = m.Simulation(cfg).run()
r = m.decode_replay_run(m.SimConfig(block_size=4, num_blocks=32, max_prompt=8, padding_tokens=0, seed=8,
                                    cache_mismatch_frac=1e-3), "cpu", use_graph=False, b=3, steps=8)
print(json.dumps({"routes": dict(s.layer.route_counts), "stats": dict(s.stats), "err": s.max_err,
                  "cos": s.min_cos, "replay_err": r.max_err, "replay_cos": r.min_cos}))
"""


def test_serving_simulation_through_the_triton_kernels_interpreted() -> None:
    """The same engine with the ops forced onto the Triton kernels (TRITON_INTERPRET=1, CPU): the
    layer's views, sliced block tables, rebased query_start_loc and head-major cache reach the real
    kernels. Tolerances are the GPU test's (the kernels' own rounding, bf16 dots)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ, ULTRAQUANT_BACKEND="triton", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_RUN, __file__], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for kind in ("store", "decode", "first", "small", "large"):
        assert res["routes"].get(kind, 0) > 0, res
    assert res["stats"]["mixed_steps"] > 0
    assert res["err"] <= 2e-2 and res["cos"] >= 0.9995, res
    assert res["replay_err"] <= 2e-2 and res["replay_cos"] >= 0.9995, res
