"""The whole-page decode's balanced schedule (a pure-Python model of the kernel's ``_schedule``,
``wholepage_schedule``): every visible token of every request in exactly one piece, equal shares per
program, unique workspace slots, each request's piece count and first program as the merging program
derives them. The kernel itself is checked against the float64 reference on the GPU
(tests/gpu/test_decode_wholepage_gpu.py)."""

from __future__ import annotations

import random

import pytest

from ultraquant.kernels.families.decode_wholepage import (
    WHOLEPAGE_MIN_SPLIT_TOKENS,
    WHOLEPAGE_PIECE_UNITS,
    stage_tokens,
    wholepage_schedule,
)


def _check(lens: list[int], programs: int, stage: int, cap: int, window: int | None) -> None:
    pieces = wholepage_schedule(lens, programs, stage, cap, window)
    min_units = max(1, WHOLEPAGE_MIN_SPLIT_TOKENS // stage)
    by_req: dict[int, list] = {}
    for p in pieces:
        by_req.setdefault(p.request, []).append(p)
        assert 0 <= p.program < programs
    assert sorted(by_req) == list(range(len(lens)))  # every request (even empty) has a piece
    for b, ps in by_req.items():
        n = min(max(lens[b], 0), cap)
        lo = max(n - window, 0) if window is not None else 0
        lo_run = lo // stage * stage
        assert [p.program for p in ps] == list(range(ps[0].program, ps[0].program + len(ps)))
        assert all(p.parts == len(ps) and p.first == ps[0].program for p in ps)
        covered = [t for p in ps for t in range(p.t_lo, max(p.t_hi, p.t_lo))]
        assert covered == list(range(lo_run, n))  # the visible tokens, once each, in order
        assert all(p.t_lo % stage == 0 for p in ps)  # pieces start on stage boundaries
    slots = [p.slot for p in pieces]
    assert len(set(slots)) == len(slots) and max(slots) < programs + len(lens)
    units: dict[int, int] = {}
    cost: dict[int, int] = {}
    per_request = [max(1, -(-(min(max(n, 0), cap) - (max(min(max(n, 0), cap) - window, 0) if window is not None
                                                      else 0) // stage * stage) // stage)) for n in lens]
    equal = len(set(per_request)) == 1 and len(lens) <= programs
    pc = 0 if equal else WHOLEPAGE_PIECE_UNITS
    for p in pieces:  # a piece's units: its stages, an empty request's 1; its cost: its units and the overhead
        u = max(1, -(-(p.t_hi - p.t_lo) // stage))
        units[p.program] = units.get(p.program, 0) + u
        cost[p.program] = cost.get(p.program, 0) + u + pc
    total = sum(per_request) + pc * len(lens)
    active = min(programs, -(-total // min_units))
    if equal:
        active = len(lens) * max(1, min(programs // len(lens), -(-per_request[0] // min_units)))
    assert len(units) <= active
    assert max(units.values()) <= -(-total // active) + len(lens)  # edge pieces round up per request
    # the shares balance cost: a program pays at most one piece (the request it continues) beyond its share
    assert max(cost.values()) <= -(-total // active) + pc + (len(lens) if equal else 0)
    assert sum(1 for p in pieces) <= active + len(lens)


@pytest.mark.parametrize("seed", range(40))
def test_schedule_random_batches(seed):
    rng = random.Random(seed)
    stage = rng.choice([64, 128, 256, 512])
    n = rng.choice([1, 2, 7, 64, 96, 300])
    hi = rng.choice([1, 100, 4096, 131072])
    lens = [rng.choice([0, rng.randint(0, hi), hi]) for _ in range(n)]
    cap = max(max(lens), 1) + rng.choice([0, 16])
    window = rng.choice([None, None, 1, 100, 5000])
    programs = rng.choice([1, 7, 132, 264])
    _check(lens, programs, stage, cap, window)


def test_schedule_balances_a_ragged_batch():
    """64 requests spread 128..16384 over 132 programs: counted as stages plus ``WHOLEPAGE_PIECE_UNITS`` per
    piece (the cost model fitted on the GPU), no program holds more than the average plus one piece, and the
    busiest program costs less than when the shares count stages alone (``piece_units=0``), where the
    programs that serve several short requests pay their pieces on top of a full share."""
    rng = random.Random(3)
    lens = [128, 16384] + [int(128 * 128 ** rng.random()) for _ in range(62)]

    def costs(piece_units: int) -> dict[int, int]:
        per: dict[int, int] = {}
        for p in wholepage_schedule(lens, 132, 64, 16384, piece_units=piece_units):
            per[p.program] = per.get(p.program, 0) + -(-(p.t_hi - p.t_lo) // 64) + WHOLEPAGE_PIECE_UNITS
        return per

    balanced, stages_only = costs(WHOLEPAGE_PIECE_UNITS), costs(0)
    average = sum(balanced.values()) / 132
    assert max(balanced.values()) <= average + WHOLEPAGE_PIECE_UNITS + 1
    assert max(balanced.values()) < max(stages_only.values()) - WHOLEPAGE_PIECE_UNITS


def test_schedule_clamps_lengths_and_uniform_matches_static_splits():
    pieces = wholepage_schedule([-5, 10**6], 4, 64, 1024)  # clamped to [0, cap] as the kernel
    assert {(p.t_lo, p.t_hi) for p in pieces if p.request == 0} == {(0, 0)}
    assert max(p.t_hi for p in pieces if p.request == 1) == 1024
    for lens, stage, want in (([32768] * 8, 64, 16), ([2048] * 64, 64, 2), ([32768] * 16, 512, 8),
                              ([1024] * 256, 64, None)):
        uniform = wholepage_schedule(lens, 132, stage, max(lens))
        per: dict[int, int] = {}
        for p in uniform:
            per[p.program] = per.get(p.program, 0) + p.t_hi - p.t_lo
        if want:  # the static split (k programs per request), no program serving two requests
            assert len(per) == want * len(lens) and all(p.parts == want for p in uniform)
            assert max(per.values()) == lens[0] // want
        else:  # more requests than programs: the balanced shares
            assert max(per.values()) <= -(-sum(lens) // 132 // stage) * stage + stage


def test_stage_tokens():
    assert stage_tokens(128, 8) == 64 and stage_tokens(128, 1) == 512 and stage_tokens(256, 2) == 128
