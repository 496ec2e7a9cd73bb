"""Every bad input raises UltraQuantError naming the argument, and leaves the cache bytes unchanged.

The same cases run against the reference and against the public ops (on CPU tensors the ops
validate identically before any kernel runs)."""

from __future__ import annotations

import pytest
import torch

import ultraquant as uq
from ultraquant import reference as R

D, HK, HQ, BS, NB = 64, 2, 4, 8, 6


def cache() -> torch.Tensor:
    return torch.randint(0, 256, (NB, BS, HK, uq.slot_size(D)), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0))


def store_args(**over):
    args = dict(key=torch.randn(3, HK, D), value=torch.randn(3, HK, D), kv_cache=cache(),
                slot_mapping=torch.tensor([0, 9, -1]))
    args.update(over)
    return args


STORE_BAD = {
    "key dtype": (dict(key=torch.randn(3, HK, D).double()), "key"),
    "key ndim": (dict(key=torch.randn(3, HK * D)), "key"),
    "value shape": (dict(value=torch.randn(3, HK, D // 2)), "value"),
    "head size": (dict(key=torch.randn(3, HK, 48), value=torch.randn(3, HK, 48)), "head_size"),
    "cache dtype": (dict(kv_cache=torch.zeros(NB, BS, HK, uq.slot_size(D), dtype=torch.int8)), "kv_cache"),
    "slot bytes": (dict(kv_cache=torch.zeros(NB, BS, HK, uq.slot_size(D) - 1, dtype=torch.uint8)), "slot_bytes"),
    "cache heads": (dict(kv_cache=torch.zeros(NB, BS, HK + 1, uq.slot_size(D), dtype=torch.uint8)), "kv heads"),
    "slot dtype": (dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), "slot_mapping"),
    "slot shape": (dict(slot_mapping=torch.tensor([0, 1])), "slot_mapping"),
    "slot range": (dict(slot_mapping=torch.tensor([0, NB * BS, 1])), "slot_mapping"),
    "not a tensor": (dict(key=[1.0, 2.0]), "key"),
}


def test_store_rejects_unknown_encoder() -> None:
    args = store_args()
    before = args["kv_cache"].clone()
    with pytest.raises(uq.UltraQuantError, match="encoder"):
        R.store_kv(**args, encoder="nearest")
    assert torch.equal(args["kv_cache"], before)


def decode_args(**over):
    args = dict(query=torch.randn(2, HQ, D), kv_cache=cache(),
                block_table=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
                seq_lens=torch.tensor([9, 5], dtype=torch.int32), scale=0.125)
    args.update(over)
    return args


DECODE_BAD = {
    "query dtype": (dict(query=torch.randn(2, HQ, D).double()), "query"),
    "gqa": (dict(query=torch.randn(2, 3, D)), "multiple of Hk"),
    "head size": (dict(query=torch.randn(2, HQ, 96)), "head_size"),
    "slot too small": (dict(query=torch.randn(2, HQ, 128)), "slot_bytes"),
    "block table dtype": (dict(block_table=torch.tensor([[1, 2], [3, 0]])), "block_table"),
    "block table rows": (dict(block_table=torch.tensor([[1, 2]], dtype=torch.int32)), "block_table"),
    "block id range": (dict(block_table=torch.tensor([[1, NB], [3, 0]], dtype=torch.int32)), "block_table"),
    "negative block id": (dict(block_table=torch.tensor([[1, 2], [-1, 0]], dtype=torch.int32)), "block_table"),
    "seq too long": (dict(seq_lens=torch.tensor([9, 17], dtype=torch.int32)), "seq_lens"),
    "seq negative": (dict(seq_lens=torch.tensor([9, -1], dtype=torch.int32)), "seq_lens"),
    "seq dtype": (dict(seq_lens=torch.tensor([9, 5])), "seq_lens"),
    "scale": (dict(scale=0.0), "scale"),
    "sinks shape": (dict(sinks=torch.zeros(HQ + 1)), "sinks"),
    "sinks dtype": (dict(sinks=torch.zeros(HQ, dtype=torch.bfloat16)), "sinks"),
    "window": (dict(sliding_window=0), "sliding_window"),
    "softcap": (dict(softcap=-1.0), "softcap"),
    "out shape": (dict(out=torch.empty(2, HQ, D + 1)), "out"),
}


def test_unused_block_table_entries_are_not_checked() -> None:
    # Entries past a request's last block are padding (vLLM leaves anything there).
    args = decode_args(block_table=torch.tensor([[1, 2], [3, -7]], dtype=torch.int32))
    assert R.decode_attention(**args).shape == (2, HQ, D)


def prefill_args(**over):
    args = dict(query=torch.randn(5, HQ, D), key=torch.randn(5, HK, D), value=torch.randn(5, HK, D),
                kv_cache=cache(), block_table=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
                seq_lens=torch.tensor([9, 2], dtype=torch.int32),
                query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32), scale=0.125)
    args.update(over)
    return args


PREFILL_BAD = {
    "key tokens": (dict(key=torch.randn(4, HK, D)), "key"),
    "qsl shape": (dict(query_start_loc=torch.tensor([0, 5], dtype=torch.int32)), "query_start_loc"),
    "qsl end": (dict(query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32)), "query_start_loc"),
    "qsl order": (dict(query_start_loc=torch.tensor([0, 6, 5], dtype=torch.int32)), "query_start_loc"),
    "chunk longer than seq": (dict(query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32)),
                              "query_start_loc"),
    "gqa": (dict(query=torch.randn(5, 3, D)), "multiple of Hk"),
    "out dtype": (dict(out=torch.empty(5, HQ, D, dtype=torch.int32)), "out"),
}


# op name -> (reference function, argument builder, bad cases); the public op has the same name
OPS = {
    "store_kv": (R.store_kv, store_args, STORE_BAD),
    "decode_attention": (R.decode_attention, decode_args, DECODE_BAD),
    "prefill_attention": (R.prefill_attention, prefill_args, PREFILL_BAD),
}
CASES = [(op, case, path) for op, (_, _, bad) in OPS.items() for case in bad for path in ("reference", "ops")]


@pytest.mark.parametrize(("op", "case", "path"), CASES, ids=["-".join(c) for c in CASES])
def test_bad_input_raises_and_leaves_cache_unchanged(op: str, case: str, path: str) -> None:
    ref_fn, build, bad = OPS[op]
    fn = ref_fn if path == "reference" else getattr(uq, op)
    over, needle = bad[case]
    args = build(**over)
    before = args["kv_cache"].clone()
    with pytest.raises(uq.UltraQuantError, match=needle):
        fn(**args)
    assert torch.equal(args["kv_cache"], before)


def test_dequant_rejects_unknown_slot_size() -> None:
    bad = torch.zeros(2, 4, 1, 100, dtype=torch.uint8)
    with pytest.raises(uq.UltraQuantError, match="slot_bytes"):
        R.dequant_kv(bad, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32))


def test_error_is_a_value_error() -> None:
    assert issubclass(uq.UltraQuantError, ValueError)


def _wide_cache(slot_bytes: int) -> torch.Tensor:
    return torch.zeros(NB, BS, HK, slot_bytes, dtype=torch.uint8)


def test_query_head_size_must_match_the_cache_slot():
    """A D=64 query over a D=128 cache (136-byte slots) is rejected by every op, naming both sizes."""
    wide = _wide_cache(uq.slot_size(128))
    q = torch.randn(2, HQ, D)
    bt = torch.zeros(2, 2, dtype=torch.int32)
    seq = torch.tensor([3, 5], dtype=torch.int32)
    calls = {
        "store": lambda: uq.store_kv(torch.randn(3, HK, D), torch.randn(3, HK, D), wide, torch.tensor([0, 1, 2])),
        "decode": lambda: uq.decode_attention(q, wide, bt, seq, 0.1),
        "prefill": lambda: uq.prefill_attention(q, torch.randn(2, HK, D), torch.randn(2, HK, D), wide, bt, seq,
                                                torch.tensor([0, 1, 2], dtype=torch.int32), 0.1),
        "dequant": lambda: uq.dequant_kv(wide, bt, seq, head_size=D),
    }
    for call in calls.values():
        with pytest.raises(uq.UltraQuantError, match=r"136 \(the slot of head size 128\).*head size 64"):
            call()


@pytest.mark.parametrize("extra, ok", [(0, True), (4, True), (12, True), (13, False), (68, False)])
def test_slot_padding_only_up_to_the_next_16_bytes(extra, ok):
    """D=64 slots are 68 bytes; padded slots up to 80 bytes (the next multiple of 16) are accepted."""
    wide = _wide_cache(uq.slot_size(D) + extra)
    args = store_args(kv_cache=wide)
    if ok:
        uq.store_kv(**args)
        R.store_kv(**store_args(kv_cache=wide.clone()))
    else:
        with pytest.raises(uq.UltraQuantError, match=rf"slot_bytes \(last dim\) {68 + extra}.*head size 64.*\(80\)"):
            uq.store_kv(**args)
