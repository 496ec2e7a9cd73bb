"""The vLLM adapter: metadata mapping on hand-built vLLM-shaped inputs, and the backend checked
against vLLM 0.33.0's own abstract interfaces.

What runs where (vLLM itself cannot be installed on the CPU CI machines: its wheel pins a CUDA torch
and ~70 dependencies):

- Always: the vLLM-free half (``ultraquant.vllm.spec``): cache shape, the ``[blocks, heads, tokens,
  bytes]`` -> ops view, decode counting, ``CommonAttentionMetadata`` -> layer metadata on
  hand-built inputs, served through the layer and compared with the reference ops; and that
  importing ultraquant never imports vLLM.
- With vLLM 0.33.0's Python sources (the wheel fetched by ``pip download vllm==0.33.0 --no-deps``
  into ~/.cache/ultraquant, or ``ULTRAQUANT_VLLM_SRC``; skipped when neither works): the REAL
  ``vllm/v1/attention/backend.py`` (AttentionBackend, AttentionImpl, AttentionMetadataBuilder,
  CommonAttentionMetadata, AttentionCGSupport), ``vllm/v1/attention/backends/registry.py``
  (AttentionBackendEnum, register_backend) and ``vllm/v1/kv_cache_layout.py`` are imported, with
  the modules they import for other purposes replaced by stubs: ``vllm`` itself (package object),
  ``vllm.logger``, ``vllm.utils.import_utils``, ``vllm.config`` (no current config),
  ``vllm.distributed.parallel_state`` (world size 1), ``vllm.v1.kv_cache_interface``
  (KVCacheLayout re-exported, get_kv_quant_mode) and the fp8 quant-key constants. Checked: our
  classes subclass the real ABCs, leave no abstract method, keep the abstract methods' parameter
  names and static/class kinds, pass ``validate_configuration``, register under ``ULTRAQUANT``,
  and the builder + impl serve a mixed batch built as a real ``CommonAttentionMetadata``.
  Not checked: vLLM's engine, model runner, CUDA-graph dispatcher, KV-cache allocator (the real
  ``AttentionSpec``: customize_spec is checked on a stand-in with the same fields) and kernel
  selection, which need a full vLLM install with a GPU.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ultraquant
from ultraquant import UltraQuantError, reference
from ultraquant.attention import AttentionMetadata, UltraQuantAttention
from ultraquant.format import SERVING_ENCODER, slot_size
from ultraquant.vllm import spec
from ultraquant.vllm.spec import VLLM_VERSION, count_decodes, kv_cache_shape, layer_metadata, ops_cache_view

# ------------------------------------------------------------------ vLLM-free half


def test_importing_ultraquant_does_not_import_vllm() -> None:
    code = ("import sys, ultraquant, ultraquant.attention, ultraquant.vllm, ultraquant.vllm.spec; "
            "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(("d", "slot"), [(64, 68), (128, 136), (256, 272), (512, 544)])
def test_kv_cache_shape(d: int, slot: int) -> None:
    assert kv_cache_shape(10, 16, 8, d) == (10, 16, 8, slot)
    assert slot == slot_size(d)


@pytest.mark.parametrize("bad", [dict(head_size=96), dict(num_blocks=0), dict(block_size=-1),
                                 dict(num_kv_heads=True)])
def test_kv_cache_shape_rejects(bad: dict) -> None:
    args = dict(num_blocks=4, block_size=16, num_kv_heads=2, head_size=128) | bad
    with pytest.raises(UltraQuantError, match=next(iter(bad))):
        kv_cache_shape(**args)


def test_ops_cache_view_is_a_view_of_vllm_layouts() -> None:
    nb, hk, bs, c = 3, 2, 4, 68
    head_major = torch.arange(nb * hk * bs * c, dtype=torch.int64).to(torch.uint8).reshape(nb, hk, bs, c)
    v = ops_cache_view(head_major)  # logical [B, H, N, C] with identity strides (LBHNC)
    assert v.shape == (nb, bs, hk, c) and v.data_ptr() == head_major.data_ptr()
    assert torch.equal(v[1, 2, 1], head_major[1, 1, 2])
    token_major = torch.zeros(nb, bs, hk, c, dtype=torch.uint8)
    logical = token_major.permute(0, 2, 1, 3)  # what vLLM hands over for LBNHC
    assert ops_cache_view(logical).is_contiguous()
    with pytest.raises(UltraQuantError, match="kv_cache"):
        ops_cache_view(torch.zeros(3, 4, 2, 68, dtype=torch.float16))


def test_count_decodes() -> None:
    qsl = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    assert count_decodes(qsl([1, 1, 1, 5, 7])) == 3
    assert count_decodes(qsl([4, 1, 1])) == 0
    assert count_decodes(qsl([1, 1, 0, 0])) == 2  # CUDA-graph padding requests: no tokens
    assert count_decodes(qsl([])) == 0
    with pytest.raises(UltraQuantError, match="query_start_loc_cpu"):
        count_decodes(torch.zeros(3, dtype=torch.float32))


def _vllm_batch(*, head_major: bool, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A vLLM-shaped batch: 2 decodes, a continuation chunk and a first chunk, 2 padding tokens.

    Returns (common metadata namespace, query, key, value, logical [B, H, N, C] cache) with the
    prefixes of every request already in the cache.
    """
    g = torch.Generator().manual_seed(seed)
    hq, hk, d, bs, nb = 4, 2, 64, 4, 16
    phys = (nb, hk, bs, slot_size(d)) if head_major else (nb, bs, hk, slot_size(d))
    buf = torch.randint(0, 256, phys, generator=g, dtype=torch.uint8)
    logical = buf if head_major else buf.permute(0, 2, 1, 3)
    cache = ops_cache_view(logical)
    q_lens, seq_lens = [1, 1, 6, 5], [9, 3, 13, 5]
    tables = [[7, 2, 11], [5], [0, 9, 14, 3], [12, 6]]
    bt = torch.zeros(4, 5, dtype=torch.int32)
    for i, row in enumerate(tables):
        bt[i, : len(row)] = torch.tensor(row)
    slots, keys, values = [], [], []
    for i, (n, total) in enumerate(zip(q_lens, seq_lens, strict=True)):
        pos = torch.arange(total)
        row_slots = bt[i, pos // bs].long() * bs + pos % bs
        k = torch.randn(total, hk, d, generator=g).to(dtype)
        v = torch.randn(total, hk, d, generator=g).to(dtype)
        if total > n:  # the prefix is already cached
            reference.store_kv(k[: total - n], v[: total - n], cache, row_slots[: total - n])
        slots.append(row_slots[total - n:])
        keys.append(k[total - n:])
        values.append(v[total - n:])
    pad = 2
    n_tok = sum(q_lens)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    common = SimpleNamespace(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=seq.clone(), num_reqs=4,
        num_actual_tokens=n_tok, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=bt, slot_mapping=torch.cat(slots + [torch.full((pad,), -1)]),
        seq_lens_cpu_upper_bound=seq.clone())
    query = torch.randn(n_tok + pad, hq, d, generator=g).to(dtype)
    key = torch.cat(keys + [torch.randn(pad, hk, d, generator=g).to(dtype)])
    value = torch.cat(values + [torch.randn(pad, hk, d, generator=g).to(dtype)])
    return common, query, key, value, logical


def _expected(common, query, key, value, cache, num_decodes: int, scale: float) -> torch.Tensor:
    """The reference ops applied straight to the batch (decodes, then the prefill rows)."""
    n = common.num_actual_tokens
    out = torch.empty(n, *query.shape[1:], dtype=query.dtype)
    nd = num_decodes
    out[:nd] = reference.decode_attention(query[:nd], cache, common.block_table_tensor[:nd],
                                          common.seq_lens[:nd], scale)
    qsl = common.query_start_loc[nd:] - nd
    out[nd:] = reference.prefill_attention(query[nd:n], key[nd:n], value[nd:n], cache,
                                           common.block_table_tensor[nd:], common.seq_lens[nd:], qsl, scale)
    return out


@pytest.mark.parametrize("head_major", [False, True])
def test_layer_metadata_maps_and_serves_a_vllm_batch(head_major: bool) -> None:
    common, query, key, value, logical = _vllm_batch(head_major=head_major)
    md = layer_metadata(common)
    assert isinstance(md, AttentionMetadata)
    assert (md.num_decodes, md.num_actual_tokens, md.num_reqs) == (2, 13, 4)
    assert (md.max_query_len, md.max_seq_len) == (6, 13)
    assert md.seq_lens.data_ptr() == common.seq_lens.data_ptr()  # views, no copies
    assert md.block_table.data_ptr() == common.block_table_tensor.data_ptr()
    assert torch.equal(md.query_start_loc_cpu, common.query_start_loc_cpu)
    assert torch.equal(md.seq_lens_cpu, common.seq_lens_cpu_upper_bound)
    layer = UltraQuantAttention(4, 2, 64, 0.125, continuation_threshold=4)
    cache = ops_cache_view(logical)
    t = query.shape[0]
    out = torch.full((t, 4 * 64), float("nan"))
    layer.forward(query.reshape(t, -1), key.reshape(t, -1), value.reshape(t, -1), cache, md, out)
    # Expected: store first (as the layer does), then the reference ops over the same cache.
    expect_cache = logical.clone()
    reference.store_kv(key[:13], value[:13], ops_cache_view(expect_cache), common.slot_mapping[:13],
                       encoder=SERVING_ENCODER)
    assert torch.equal(expect_cache, logical)
    expect = _expected(common, query, key, value, cache, 2, 0.125)
    torch.testing.assert_close(out[:13].view(13, 4, 64), expect, atol=1e-5, rtol=1e-5)
    assert torch.isnan(out[13:]).all()
    assert dict(layer.route_counts) == {"store": 1, "decode": 1, "large": 1, "first": 1}


def test_layer_metadata_without_upper_bound_and_with_padded_requests() -> None:
    common, *_ = _vllm_batch(head_major=False)
    del common.seq_lens_cpu_upper_bound
    common.seq_lens_cpu = common.seq_lens.clone()
    common.num_reqs = 3  # rows past num_reqs are a padded persistent buffer
    md = layer_metadata(common)
    assert md.num_reqs == 3 and md.block_table.shape[0] == 3 and md.query_start_loc.shape[0] == 4
    assert torch.equal(md.seq_lens_cpu, common.seq_lens[:3])
    del common.seq_lens_cpu
    assert layer_metadata(common).seq_lens_cpu is None


def test_register_without_vllm_says_so(caplog: pytest.LogCaptureFixture) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    from ultraquant.vllm import register

    with caplog.at_level(logging.WARNING, logger="ultraquant.vllm"):
        assert register() is False
    assert "not registered" in caplog.text


def test_entry_point_declared() -> None:
    """pyproject.toml names register() as a vllm.general_plugins entry point."""
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '[project.entry-points."vllm.general_plugins"]' in text
    assert 'ultraquant = "ultraquant.vllm:register"' in text


# ------------------------------------------------------------------ against vLLM 0.33.0's sources

_NEEDED = (
    "vllm/v1/__init__.py",
    "vllm/v1/attention/__init__.py",
    "vllm/v1/attention/backend.py",
    "vllm/v1/attention/backends/__init__.py",
    "vllm/v1/attention/backends/registry.py",
    "vllm/v1/kv_cache_layout.py",
)


def _vllm_source() -> Path | None:
    """A directory holding vLLM 0.33.0's files in _NEEDED (fetched once with pip into a cache)."""
    root = Path(os.environ.get("ULTRAQUANT_VLLM_SRC")
                or Path.home() / ".cache" / "ultraquant" / f"vllm-{VLLM_VERSION}-src")
    if all((root / f).is_file() for f in _NEEDED):
        return root
    if os.environ.get("ULTRAQUANT_NO_VLLM_DOWNLOAD") == "1":
        return None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir",
                            "-d", tmp, f"vllm=={VLLM_VERSION}"], check=True, timeout=600,
                           capture_output=True)
        except (subprocess.SubprocessError, OSError):
            return None
        wheels = list(Path(tmp).glob("vllm-*.whl"))
        if not wheels:
            return None
        with zipfile.ZipFile(wheels[0]) as zf:
            for name in _NEEDED:
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                (root / name).write_bytes(zf.read(name))
    return root


def _stub(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


@pytest.fixture(scope="module")
def vllm_env():
    """Import vLLM 0.33.0's real backend interfaces over stubs (see the module docstring)."""
    if importlib.util.find_spec("vllm") is not None:
        import vllm  # a real install: use it as it is

        if not str(getattr(vllm, "__version__", "")).startswith(VLLM_VERSION):
            pytest.skip(f"installed vllm {vllm.__version__} is not the targeted {VLLM_VERSION}")
        yield "installed"
        return
    src = _vllm_source()
    if src is None:
        pytest.skip(f"vLLM {VLLM_VERSION} sources unavailable (pip download failed or disabled)")
    saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    pkg = _stub("vllm", __path__=[str(src / "vllm")], __version__=VLLM_VERSION)

    class _NoPcp:
        @property
        def world_size(self):
            raise AssertionError("no PCP group")

    def resolve(qualname: str):
        module, _, obj = qualname.rpartition(".")
        return getattr(importlib.import_module(module), obj)

    stubs = {
        "vllm": pkg,
        "vllm.logger": _stub("vllm.logger", init_logger=logging.getLogger),
        "vllm.utils": _stub("vllm.utils", __path__=[]),
        "vllm.utils.import_utils": _stub("vllm.utils.import_utils", resolve_obj_by_qualname=resolve),
        "vllm.config": _stub("vllm.config", get_current_vllm_config_or_none=lambda: None),
        "vllm.distributed": _stub("vllm.distributed", __path__=[]),
        "vllm.distributed.parallel_state": _stub(
            "vllm.distributed.parallel_state", get_dcp_world_size_and_rank=lambda *a: (1, 0),
            get_pcp_group=lambda: _NoPcp()),
        "vllm.model_executor": _stub("vllm.model_executor", __path__=[]),
        "vllm.model_executor.layers": _stub("vllm.model_executor.layers", __path__=[]),
        "vllm.model_executor.layers.quantization": _stub("vllm.model_executor.layers.quantization",
                                                         __path__=[]),
        "vllm.model_executor.layers.quantization.utils": _stub(
            "vllm.model_executor.layers.quantization.utils", __path__=[]),
        "vllm.model_executor.layers.quantization.utils.quant_utils": _stub(
            "vllm.model_executor.layers.quantization.utils.quant_utils", kFp8Dynamic64Sym=object(),
            kFp8Dynamic128Sym=object(), kFp8StaticTensorSym=object(), kNvfp4Dynamic=object()),
    }
    for k in saved:
        del sys.modules[k]
    sys.modules.update(stubs)
    layout = importlib.import_module("vllm.v1.kv_cache_layout")
    sys.modules["vllm.v1.kv_cache_interface"] = _stub(
        "vllm.v1.kv_cache_interface", KVCacheLayout=layout.KVCacheLayout,
        get_kv_quant_mode=lambda dtype: SimpleNamespace(name=str(dtype)))
    try:
        yield str(src)
    finally:
        for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
            del sys.modules[k]
        sys.modules.pop("ultraquant.vllm.backend", None)
        sys.modules.update(saved)


def _modules(vllm_env):
    from vllm.v1.attention import backend as vb
    from vllm.v1.attention.backends import registry

    from ultraquant.vllm import backend as ub

    return vb, registry, ub


def test_backend_implements_the_abstract_interfaces(vllm_env) -> None:
    vb, _, ub = _modules(vllm_env)
    pairs = [(ub.UltraQuantBackend, vb.AttentionBackend), (ub.UltraQuantImpl, vb.AttentionImpl),
             (ub.UltraQuantMetadataBuilder, vb.AttentionMetadataBuilder)]
    for ours, base in pairs:
        assert issubclass(ours, base)
        assert not inspect.isabstract(ours), (ours, getattr(ours, "__abstractmethods__", None))
        assert base.__abstractmethods__, base  # the check is not vacuous
        for name in set(base.__abstractmethods__) | {n for n in vars(ours) if n in vars(base)}:
            if name.startswith("__") and name != "__init__":
                continue
            theirs_raw, ours_raw = inspect.getattr_static(base, name), inspect.getattr_static(ours, name)
            if not callable(theirs_raw) and not isinstance(theirs_raw, (staticmethod, classmethod)):
                continue
            assert type(theirs_raw) is type(ours_raw), (ours.__name__, name, "static/class kind differs")
            theirs_params = list(inspect.signature(getattr(base, name)).parameters.values())
            ours_params = list(inspect.signature(getattr(ours, name)).parameters.values())
            named = [p.name for p in theirs_params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
            assert [p.name for p in ours_params][: len(named)] == named, (ours.__name__, name)
            extra = ours_params[len(named):]
            assert all(p.default is not p.empty or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
                       for p in extra), (ours.__name__, name, "new required parameters")
    assert issubclass(ub.UltraQuantVllmMetadata, vb.AttentionMetadata)


def test_backend_capabilities(vllm_env) -> None:
    vb, _, ub = _modules(vllm_env)
    be = ub.UltraQuantBackend
    ok = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="ultraquant_4bit", block_size=64,
              use_mla=False, has_sink=True, use_sparse=False, use_mm_prefix=False,
              use_per_head_quant_scales=False, device_capability=None, attn_type="decoder",
              has_sliding_window=True)
    assert be.validate_configuration(**ok) == []
    assert be.validate_configuration(**(ok | dict(device_capability=SimpleNamespace(major=9, minor=0)))) == []
    for change, reason in [(dict(head_size=96), "head_size"), (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
                           (dict(block_size=8), "block_size"), (dict(dtype=torch.float32), "dtype"),
                           (dict(use_mla=True), "MLA"), (dict(attn_type="encoder"), "attention type"),
                           (dict(device_capability=SimpleNamespace(major=7, minor=5)), "compute capability")]:
        reasons = be.validate_configuration(**(ok | change))
        assert any(reason in r for r in reasons), (change, reasons)
    assert be.get_name() == "ULTRAQUANT"
    assert be.get_preferred_block_size(16) == 16 and be.get_preferred_block_size(8) == 16
    assert be.forward_includes_kv_cache_update is False
    layouts = be.supported_kv_cache_layouts()
    assert [x.name for x in layouts] == ["LBHNC", "LBNHC"]
    assert be.get_kv_cache_shape(10, 64, 8, 128) == (10, 64, 8, 136)
    from dataclasses import dataclass, field

    @dataclass(frozen=True)
    class SpecStandIn:  # the fields of vLLM's AttentionSpec that customize_spec reads
        head_size: int
        kv_quant_mode: object = field(default_factory=lambda: SimpleNamespace(is_ultraquant=True))
        state_content_bytes: int | None = None

    assert be.customize_spec(SpecStandIn(256)).state_content_bytes == 272
    other = SpecStandIn(256, SimpleNamespace(is_ultraquant=False))
    assert be.customize_spec(other) is other


def test_register_routes_the_ultraquant_backend(vllm_env) -> None:
    _, registry, ub = _modules(vllm_env)
    from ultraquant.vllm import BACKEND_CLASS, register

    member = registry.AttentionBackendEnum.ULTRAQUANT
    try:
        assert register() is True
        assert register() is True  # idempotent
        assert member.get_path() == BACKEND_CLASS
        assert member.get_class() is ub.UltraQuantBackend
        assert registry.AttentionBackendEnum[ub.UltraQuantBackend.get_name()] is member
    finally:
        member.clear_override()


def _common_metadata(vb, common):
    """vLLM's own ``CommonAttentionMetadata`` of a :func:`_vllm_batch` namespace."""
    return vb.CommonAttentionMetadata(
        query_start_loc=common.query_start_loc, query_start_loc_cpu=common.query_start_loc_cpu,
        seq_lens=common.seq_lens, num_reqs=common.num_reqs, num_actual_tokens=common.num_actual_tokens,
        max_query_len=common.max_query_len, max_seq_len=common.max_seq_len,
        block_table_tensor=common.block_table_tensor, slot_mapping=common.slot_mapping,
        seq_lens_cpu_upper_bound=common.seq_lens_cpu_upper_bound)


@pytest.mark.parametrize("head_major", [False, True])
def test_builder_and_impl_serve_a_vllm_batch(vllm_env, head_major: bool) -> None:
    vb, _, ub = _modules(vllm_env)
    common, query, key, value, logical = _vllm_batch(head_major=head_major, dtype=torch.bfloat16, seed=1)
    cam = _common_metadata(vb, common)
    config = SimpleNamespace(parallel_config=SimpleNamespace(decode_context_parallel_size=1),
                             speculative_config=None)
    builder = ub.UltraQuantMetadataBuilder(SimpleNamespace(block_size=4), ["layer.0"], config,
                                           torch.device("cpu"))
    assert builder.reorder_batch_threshold == 1
    assert (builder.get_cudagraph_support(config, None)
            is vb.AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    md = builder.build(0, cam)
    assert isinstance(md, vb.AttentionMetadata) and md.num_decodes == 2
    assert builder.build_for_cudagraph_capture(cam).num_actual_tokens == 13
    scale = 0.125
    assert ub._serving_limits() == (0, 0)  # no vLLM config being built: no decode warm-up
    config_mod = sys.modules["vllm.config"]
    real_get = config_mod.get_current_vllm_config_or_none
    config_mod.get_current_vllm_config_or_none = lambda: SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=3), model_config=SimpleNamespace(max_model_len=20))
    try:
        assert ub._serving_limits() == (3, 20)
    finally:
        config_mod.get_current_vllm_config_or_none = real_get
    impl = ub.UltraQuantImpl(4, 64, scale, 2, None, None, "ultraquant_4bit", None, "decoder", None)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ub.UltraQuantImpl(4, 64, scale, 2, kv_cache_dtype="fp8")
    with pytest.raises(NotImplementedError, match="KV sharing"):
        ub.UltraQuantImpl(4, 64, scale, 2, kv_cache_dtype="ultraquant_4bit", kv_sharing_target_layer_name="x")
    with pytest.raises(NotImplementedError, match="ALiBi"):
        ub.UltraQuantImpl(4, 64, scale, 2, alibi_slopes=[1.0] * 4, kv_cache_dtype="ultraquant_4bit")
    t = query.shape[0]
    before = logical.clone()
    n = common.num_actual_tokens
    impl.do_kv_cache_update(None, key, value, logical, common.slot_mapping[:n])
    out = torch.full((t, 4, 64), float("nan"), dtype=torch.bfloat16)
    assert impl.forward(None, query, key, value, logical, md, out) is out
    reference.store_kv(key[:n], value[:n], ops_cache_view(before), common.slot_mapping[:n], encoder=SERVING_ENCODER)
    assert torch.equal(before, logical)
    expect = _expected(common, query, key, value, ops_cache_view(logical), 2, scale)
    torch.testing.assert_close(out[:n], expect, atol=2e-2, rtol=2e-2)
    assert impl.forward(None, query, key, value, logical, None, out) is out and not out.any()
    _ = ultraquant  # the public package stays importable alongside the stubs
    assert spec.BACKEND_NAME == ub.UltraQuantBackend.get_name()


def test_builder_under_speculative_decoding(vllm_env) -> None:
    """With 3 speculative tokens: requests of 1..4 tokens are decodes (one spec-decoding launch), uniform
    decode batches get CUDA graphs that replay any counts up to 4; the step serves like the reference."""
    vb, _, ub = _modules(vllm_env)
    common, query, key, value, logical = _vllm_batch(head_major=True, seed=2)
    cam = _common_metadata(vb, common)
    config = SimpleNamespace(parallel_config=SimpleNamespace(decode_context_parallel_size=1),
                             speculative_config=SimpleNamespace(num_speculative_tokens=3, parallel_drafting=False),
                             use_v2_model_runner=True)
    builder = ub.UltraQuantMetadataBuilder(SimpleNamespace(block_size=4), ["layer.0"], config, torch.device("cpu"))
    assert builder.reorder_batch_threshold == 4
    assert builder.get_cudagraph_support(config, None) is vb.AttentionCGSupport.UNIFORM_BATCH
    assert builder.get_varlen_cudagraph_max_query_len(config, None) == 4
    md = builder.build(0, cam)
    assert (md.num_decodes, md.num_decode_tokens, md.decode_query_len) == (2, 2, 4)  # the 6-token chunk stops it
    impl = ub.UltraQuantImpl(4, 64, 0.125, 2, None, None, "ultraquant_4bit", None, "decoder", None)
    n = common.num_actual_tokens
    impl.do_kv_cache_update(None, key, value, logical, common.slot_mapping[:n])
    out = torch.full((query.shape[0], 4, 64), float("nan"))
    impl.forward(None, query, key, value, logical, md, out)
    assert impl.attn.route_counts["spec_decode"] == 1
    expect = _expected(common, query, key, value, ops_cache_view(logical), 2, 0.125)
    torch.testing.assert_close(out[:n], expect, atol=2e-2, rtol=2e-2)


def test_serving_simulation_through_vllm_classes(vllm_env) -> None:
    """The serving simulation with every step going through vLLM's path: a real
    ``CommonAttentionMetadata`` -> our builder -> ``do_kv_cache_update`` + ``forward`` of our impl on
    the logical ``[blocks, heads, tokens, bytes]`` cache view, 3-D query/output as vLLM passes them."""
    from tests.test_serving_sim import SimConfig, Simulation

    vb, _, ub = _modules(vllm_env)
    config = SimpleNamespace(parallel_config=SimpleNamespace(decode_context_parallel_size=1),
                             speculative_config=None)

    class VllmDriven(Simulation):
        def __init__(self, cfg: SimConfig) -> None:
            super().__init__(cfg)
            self.impl = ub.UltraQuantImpl(cfg.num_heads, cfg.head_size, self.scale, cfg.num_kv_heads, None,
                                          cfg.window, "ultraquant_4bit", cfg.softcap, "decoder", None,
                                          sinks=self.sinks)
            self.impl.attn._threshold = cfg.threshold
            self.layer = self.impl.attn  # the route counts the test reads
            self.builder = ub.UltraQuantMetadataBuilder(SimpleNamespace(block_size=cfg.block_size), ["l0"],
                                                        config, torch.device("cpu"))

        def forward_batch(self, query, key, value, md, out) -> None:
            n = md.num_actual_tokens
            cam = vb.CommonAttentionMetadata(
                query_start_loc=md.query_start_loc, query_start_loc_cpu=md.query_start_loc_cpu,
                seq_lens=md.seq_lens, num_reqs=md.num_reqs, num_actual_tokens=n,
                max_query_len=md.max_query_len, max_seq_len=md.max_seq_len,
                block_table_tensor=md.block_table, slot_mapping=md.slot_mapping,
                seq_lens_cpu_upper_bound=md.seq_lens_cpu)
            attn_md = self.builder.build(0, cam)
            assert attn_md.num_decodes == md.num_decodes
            t, hq, hk, d = query.shape[0], self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_size
            logical = self.kv_cache.transpose(1, 2)  # what vLLM hands a layer: [blocks, heads, tokens, bytes]
            k3, v3 = key.view(t, hk, d), value.view(t, hk, d)
            self.impl.do_kv_cache_update(None, k3, v3, logical, md.slot_mapping[:n])
            self.impl.forward(None, query.view(t, hq, d), k3, v3, logical, attn_md, out.view(t, hq, d))

    cfg = SimConfig(encoder=SERVING_ENCODER, dtype=torch.bfloat16, head_major=True, sinks=True, window=7,
                    softcap=10.0, seed=4, num_requests=8)
    s = VllmDriven(cfg).run()
    for kind in ("store", "decode", "first", "small", "large"):
        assert s.layer.route_counts[kind] > 0, dict(s.layer.route_counts)
    assert s.stats["mixed_steps"] > 0 and s.reused_blocks > 0
    assert s.max_err <= 1e-2 and s.min_cos >= 1 - 1e-2, (s.max_err, s.min_cos)


def test_profiling_run_reserves_the_dense_workspace(vllm_env) -> None:
    """vLLM measures free memory after its profiling run (attn_metadata None): the dense prefill
    workspace for a max_model_len request must exist by then."""
    _, _, ub = _modules(vllm_env)
    config_mod = sys.modules["vllm.config"]
    real_get = config_mod.get_current_vllm_config_or_none
    config_mod.get_current_vllm_config_or_none = lambda: SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=3), model_config=SimpleNamespace(max_model_len=40),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    try:
        impl = ub.UltraQuantImpl(4, 64, 0.125, 2, None, None, "ultraquant_4bit", None, "decoder", None)
    finally:
        config_mod.get_current_vllm_config_or_none = real_get
    from ultraquant import dense

    ws = impl.attn._dense_ws = dense.DenseWorkspace()  # fresh: the shared one may be grown by other tests
    assert ws.reserve(0, torch.float16, "cpu") == 0
    out = torch.ones(5, 4, 64, dtype=torch.float16)
    impl.forward(None, out, out, out, torch.zeros(1), None, out)
    assert not out.any()
    assert ws.reserve(0, torch.float16, "cpu") >= 2 * impl.attn._dense_elements(39, 40) > 0
