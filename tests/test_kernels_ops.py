"""The public ops as PyTorch custom ops: schema/fake-impl consistency (torch.library.opcheck) and
tracing through torch.compile (fullgraph, what vLLM relies on). CPU tensors: the reference backend
runs underneath, so this checks the op registration, not the kernels."""

from __future__ import annotations

import pytest
import torch

import ultraquant as uq
from tests.helpers import make_paged
from ultraquant import reference as R


def _decode_args():
    prob = make_paged([5, 17], 2, 64, 16, seed=1, dtype=torch.bfloat16)
    query = torch.randn(2, 4, 64).to(torch.bfloat16)
    return prob, query


def test_decode_op_passes_opcheck():
    prob, query = _decode_args()
    out = torch.empty_like(query)
    sinks = torch.randn(4)
    args = (query, prob.kv_cache, prob.block_table, prob.seq_lens, 0.125, sinks, 8, 20.0, out)
    torch.library.opcheck(torch.ops.ultraquant.decode_attention.default, args)


def test_store_op_passes_opcheck():
    key = torch.randn(3, 2, 64).to(torch.bfloat16)
    cache = torch.zeros(2, 16, 2, uq.slot_size(64), dtype=torch.uint8)
    slots = torch.tensor([0, -1, 5])
    torch.library.opcheck(torch.ops.ultraquant.store_kv.default, (key, key, cache, slots, "rne"))


def test_prefill_op_passes_opcheck():
    prob = make_paged([6, 0], 2, 64, 16, seed=2, dtype=torch.bfloat16)
    bt = torch.zeros(2, 2, dtype=torch.int32)
    bt[:, : prob.block_table.shape[1]] = prob.block_table
    seq_lens = torch.tensor([9, 4], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 7], dtype=torch.int32)
    q = torch.randn(7, 4, 64).to(torch.bfloat16)
    k = torch.randn(7, 2, 64).to(torch.bfloat16)
    out = torch.empty_like(q)
    args = (q, k, k, prob.kv_cache, bt, seq_lens, qsl, 0.125, None, None, None, out)
    torch.library.opcheck(torch.ops.ultraquant.prefill_attention.default, args)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_decode_traces_under_torch_compile(backend):
    prob, query = _decode_args()

    def step(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        uq.decode_attention(q * 1.0, prob.kv_cache, prob.block_table, prob.seq_lens, 0.125, out=out)
        return out + 0

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    got = compiled(query, torch.empty_like(query))
    ref = R.decode_attention(query, prob.kv_cache, prob.block_table, prob.seq_lens, 0.125)
    torch.testing.assert_close(got, ref)
