"""Device workspaces of split-KV decode and prefill, and stand-ins for absent optional pointers.

One workspace per device, grown (never freed) when a call needs more: a CUDA graph captured earlier
still holds the old buffers' addresses.
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_workspaces: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_retired: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
"""Workspaces replaced by larger ones: kept alive forever, because a CUDA graph captured earlier
still holds their addresses (freeing them would let a replay write into reused memory)."""
_dummies: dict[str, torch.Tensor] = {}


def decode_workspace(device: torch.device, part_elems: int, ml_elems: int,
                     counters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 partials, fp32 (m, l) rows and zeroed int32 tickets for split-KV decode and prefill,
    cached per device (the two ops run one after the other on a stream, never concurrently).

    Grows (reallocates) only when a call needs more than any earlier one; the smaller buffers stay
    allocated (graphs captured with them keep working). Warm up with the largest batch before
    capturing a CUDA graph, so that no allocation happens during capture. The kernel resets each
    ticket to 0 after use, so the counters stay valid across calls and graph replays. One workspace
    per device: concurrent launches on different streams of one device would race on it.
    """
    key = str(device)
    with _lock:
        ws = _workspaces.get(key)
        if ws is None or ws[0].numel() < part_elems or ws[1].numel() < ml_elems or ws[2].numel() < counters:
            if ws is not None:
                _retired.append(ws)
            old = ws or (torch.empty(0), torch.empty(0), torch.empty(0))
            ws = (torch.empty(max(part_elems, old[0].numel(), 1), dtype=torch.float32, device=device),
                  torch.empty(max(ml_elems, old[1].numel(), 1), dtype=torch.float32, device=device),
                  torch.zeros(max(counters, old[2].numel(), 1), dtype=torch.int32, device=device))
            _workspaces[key] = ws
        return ws


def dummy_f32(device: torch.device) -> torch.Tensor:
    """A 1-element fp32 tensor standing in for an absent optional pointer (never read)."""
    key = str(device)
    if key not in _dummies:
        _dummies[key] = torch.zeros(1, dtype=torch.float32, device=device)
    return _dummies[key]


def dummy_i32(device: torch.device) -> torch.Tensor:
    """A 1-element int32 tensor standing in for an unused ticket buffer (never touched)."""
    key = f"i32:{device}"
    if key not in _dummies:
        _dummies[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return _dummies[key]


