"""Test helpers: random paged caches with shuffled block tables (shared by CPU and GPU tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import ultraquant as uq
from ultraquant import reference as R


@dataclass
class PagedProblem:
    """A filled paged cache plus the unquantized K/V that went into it."""

    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    keys: list[torch.Tensor]  # raw (L_i, Hk, D) per request
    values: list[torch.Tensor]


def make_paged(seq_lens: list[int], num_kv_heads: int, head_size: int, block_size: int, *,
               seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu",
               head_major: bool = False, spare_blocks: int = 3, encoder: str = "rne",
               store=None) -> PagedProblem:
    """Random K/V for each request stored through ``store`` (default: the reference) into a cache
    whose blocks are handed out from a shuffled free list; unused cache bytes are random poison."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum((n + block_size - 1) // block_size for n in seq_lens) + spare_blocks
    slot = uq.slot_size(head_size)
    shape = (num_blocks, num_kv_heads, block_size, slot) if head_major else (
        num_blocks, block_size, num_kv_heads, slot)
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    kv_cache = raw.permute(0, 2, 1, 3) if head_major else raw
    block_table, slot_mapping = R.allocate_blocks(seq_lens, block_size, num_blocks, gen)
    keys, values = [], []
    for n in seq_lens:
        keys.append(torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype))
        values.append(torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype))
    key = torch.cat(keys).to(device)
    value = torch.cat(values).to(device)
    slot_mapping = slot_mapping.to(device)
    kv_cache = kv_cache.to(device)
    (store or R.store_kv)(key, value, kv_cache, slot_mapping, encoder=encoder)
    return PagedProblem(kv_cache, block_table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
                        keys, values)


def layer_batch(q_lens: tuple[int, ...] | list[int], seq_lens: tuple[int, ...] | list[int], *, num_heads: int,
                num_kv_heads: int, head_size: int, block_size: int, num_blocks: int, seed: int = 0,
                dtype: torch.dtype = torch.float32, encoder: str = "rne"):
    """A mixed batch for the attention layer: request i has ``seq_lens[i]`` tokens, of which the last
    ``q_lens[i]`` are new (their K/V are returned, not stored); the prefix is stored by the reference
    with ``encoder``. Returns (AttentionMetadata, query, new keys, new values, cache)."""
    from ultraquant.attention import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    cache = torch.randint(0, 256, (num_blocks, block_size, num_kv_heads, uq.slot_size(head_size)), generator=g,
                          dtype=torch.uint8)
    table, all_slots = R.allocate_blocks(list(seq_lens), block_size, num_blocks, g)
    tables = [table[i, : -(-total // block_size)].tolist() for i, total in enumerate(seq_lens)]
    slots, keys, values = [], [], []
    start = 0
    for n, total in zip(q_lens, seq_lens, strict=True):
        s = all_slots[start : start + total]
        start += total
        k = torch.randn(total, num_kv_heads, head_size, generator=g).to(dtype)
        v = torch.randn(total, num_kv_heads, head_size, generator=g).to(dtype)
        if total > n:
            R.store_kv(k[: total - n], v[: total - n], cache, s[: total - n], encoder=encoder)
        slots.append(s[total - n :])
        keys.append(k[total - n :])
        values.append(v[total - n :])
    md = AttentionMetadata.build(query_lens=list(q_lens), seq_lens=list(seq_lens), block_table=tables,
                                 slot_mapping=torch.cat(slots))
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=g).to(dtype)
    return md, query, torch.cat(keys), torch.cat(values), cache


def guarded(shape: tuple[int, ...], dtype: torch.dtype, fill: float | int, guard: int,
            device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous ``shape`` view in the middle of a larger buffer of ``fill`` with ``guard``
    elements on each side: (view, whole buffer). A write past the view changes a guard element."""
    n = 1
    for s in shape:
        n *= s
    whole = torch.full((guard + n + guard,), fill, dtype=dtype, device=device)
    return whole[guard: guard + n].view(shape), whole


def guards_intact(whole: torch.Tensor, view: torch.Tensor, fill: float | int) -> bool:
    """True when every element of ``whole`` outside ``view`` (from :func:`guarded`) is still ``fill``."""
    start, n = view.storage_offset(), view.numel()
    return bool((whole[:start] == fill).all() and (whole[start + n:] == fill).all())


def fill_cache(kv_cache: torch.Tensor, head_size: int, seed: int) -> None:
    """Store random K/V (the reference's encoder) into every slot of ``kv_cache``."""
    nb, bs, hk, _ = kv_cache.shape
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(nb * bs, hk, head_size, generator=gen)
    value = torch.randn(nb * bs, hk, head_size, generator=gen)
    slots = torch.arange(nb * bs)
    if kv_cache.device.type == "cpu":
        R.store_kv(key, value, kv_cache, slots)
    else:
        cpu = kv_cache.cpu()
        R.store_kv(key, value, cpu, slots)
        kv_cache.copy_(cpu)


def carved_cache(nblocks: int, bs: int, hk: int, slot_bytes: int, offset: int, seed: int,
                 device: str = "cpu") -> torch.Tensor:
    """A random (nblocks, bs, hk, slot_bytes) uint8 cache whose first byte lies ``offset`` bytes past a
    16-byte boundary (a view into a larger buffer): the unaligned caches a store must also serve."""
    buf = torch.randint(0, 256, (offset + nblocks * bs * hk * slot_bytes + 16,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed)).to(device)
    shift = (-buf.data_ptr()) % 16 + offset
    return buf[shift: shift + nblocks * bs * hk * slot_bytes].view(nblocks, bs, hk, slot_bytes)


def force_target(monkeypatch, target: str) -> None:
    """Make every plan see ``target`` (``"cuda"``, ``"hip"``, ``"portable"``) as its device's code-generation
    target: each module that plans launches imported ``target_of`` itself."""
    from ultraquant import policy
    from ultraquant.kernels import plans
    from ultraquant.kernels.families import store

    for module in (plans, store, policy):
        monkeypatch.setattr(module, "target_of", lambda device: target)
