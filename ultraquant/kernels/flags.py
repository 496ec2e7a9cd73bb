"""Device-side error words: what the kernels report about out-of-range inputs, read by
:func:`ultraquant.check_errors`.

Every kernel gets ``err_ptr``, a per-device int32 buffer of :data:`ERROR_WORDS` words. On an
out-of-range value a kernel does what is safe (skip the row, read the block as empty, clamp the
length) and stores 1 into the word of that condition: a plain store, no atomics, no host sync; any
number of programs may store at once. :func:`read_errors` turns nonzero words into
:class:`KernelError` bits and zeroes them. The buffer is allocated once per device and never freed
(a captured CUDA graph keeps its address).
"""

from __future__ import annotations

import enum
import threading

import torch


class KernelError(enum.IntFlag):
    """Bit ``1 << i`` is set when error word ``i`` is nonzero."""

    SLOT_OUT_OF_RANGE = 1
    """store: a slot_mapping entry >= num_slots = num_blocks * block_size (the row was skipped;
    negative = padding, never an error)."""
    BLOCK_OUT_OF_RANGE = 2
    """decode / prefill / dequant: a block id outside [0, num_blocks) in the used part of a block-table
    row (read as an empty block: its tokens are masked out, dequant writes zeros for them)."""
    SEQ_LEN_OUT_OF_RANGE = 4
    """decode / prefill / dequant: a seq_len < 0 or longer than the block-table row (clamped to the
    row's capacity); dequant: a row past the end of k_out/v_out (cu_seqlens + seq_lens), not written."""


ERROR_WORDS = 4
"""int32 words per device (one per :class:`KernelError` bit, one spare)."""

_lock = threading.Lock()
_buffers: dict[str, torch.Tensor] = {}
_by_device: dict[torch.device, torch.Tensor] = {}


def _key(device: torch.device | str) -> str:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def error_words(device: torch.device) -> torch.Tensor:
    """The device's zeroed error words (created on first use, then always the same tensor; every plan
    asks, so the hit is one dict lookup on the device object)."""
    buf = _by_device.get(device)
    if buf is None:
        key = _key(device)
        with _lock:
            buf = _buffers.get(key)
            if buf is None:
                buf = _buffers[key] = torch.zeros(ERROR_WORDS, dtype=torch.int32, device=device)
            _by_device[device] = buf
    return buf


def read_errors(device: torch.device | str | None = None) -> KernelError:
    """The errors reported since the last read on ``device`` (every device used so far when None),
    then reset. Copies the words to the host: synchronizes with the current stream, so call it
    between steps, not inside a captured graph."""
    keys = list(_buffers) if device is None else [_key(device)]
    found = KernelError(0)
    for key in keys:
        buf = _buffers.get(key)
        if buf is None:
            continue
        words = buf.tolist()
        buf.zero_()
        for i, w in enumerate(words[: len(KernelError)]):
            if w:
                found |= KernelError(1 << i)
    return found
