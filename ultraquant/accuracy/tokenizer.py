"""A byte-level BPE tokenizer built from a GGUF file's ``tokenizer.ggml.*`` fields.

SmolLM2 uses GPT-2 style byte-level BPE with its digits split one by one (llama.cpp's "smollm"
pre-tokenizer). Only encoding is needed here (the accuracy run scores a fixed text), so this is a
small pure-Python implementation instead of a dependency on a tokenizer library; the words of a
text repeat a lot, so a per-word cache makes it fast enough for a few thousand tokens.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from ..errors import UltraQuantError

# GPT-2's pre-tokenizer regex with Python's `re` classes standing in for \p{L} / \p{N}:
# [^\W\d_] is "a letter", \d "a digit" (each digit its own piece, as the smollm pre-tokenizer does).
_PRETOKENIZE = re.compile(r"\d|'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?(?:_|[^\s\w])+|\s+(?!\S)|\s+")


@functools.lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class BPETokenizer:
    """Encode text to token ids with a vocabulary and ranked merges (byte-level BPE)."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str]) -> None:
        if not tokens or not merges:
            raise UltraQuantError("tokens/merges: the GGUF file carries no BPE vocabulary")
        self.vocab = {tok: i for i, tok in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self._cache: dict[str, tuple[int, ...]] = {}

    def _bpe(self, word: str) -> tuple[int, ...]:
        """Token ids of one pre-tokenized piece: apply the lowest-ranked merge until none applies."""
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        parts = list(word)
        while len(parts) > 1:
            best, best_rank = -1, None
            for i in range(len(parts) - 1):
                rank = self.ranks.get((parts[i], parts[i + 1]))
                if rank is not None and (best_rank is None or rank < best_rank):
                    best, best_rank = i, rank
            if best_rank is None:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        try:
            ids = tuple(self.vocab[p] for p in parts)
        except KeyError as exc:  # every single byte is in a byte-level vocabulary; a miss is a bad file
            raise UltraQuantError(f"tokens: piece {exc.args[0]!r} is missing from the vocabulary") from None
        self._cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        table = _byte_to_unicode()
        ids: list[int] = []
        for piece in _PRETOKENIZE.findall(text):
            ids.extend(self._bpe("".join(table[b] for b in piece.encode("utf-8"))))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (for reports and debugging)."""
        inverse = {v: k for k, v in _byte_to_unicode().items()}
        id_to_tok = {i: t for t, i in self.vocab.items()}
        data = bytes(inverse[c] for i in ids for c in id_to_tok[int(i)] if c in inverse)
        return data.decode("utf-8", errors="replace")
