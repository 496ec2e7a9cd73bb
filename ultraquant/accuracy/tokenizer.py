"""The model's byte-level BPE tokenizer, built with HF ``tokenizers`` from a GGUF's ``tokenizer.ggml.*``.

The pre-tokenizer follows ``tokenizer.ggml.pre`` as llama.cpp and the model's own ``tokenizer.json``
do: ``smollm`` splits every digit into its own piece before GPT-2's byte-level regex.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import UltraQuantError

PRE_TOKENIZERS = ("gpt2", "smollm")
"""The ``tokenizer.ggml.pre`` values understood here."""


class BPETokenizer:
    """Encode/decode text with a GGUF's vocabulary and ranked merges (GPT-2 style byte-level BPE)."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], pre: str) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # the `accuracy` extra

        if not tokens or not merges:
            raise UltraQuantError("tokens/merges: the GGUF file carries no BPE vocabulary")
        if pre not in PRE_TOKENIZERS:
            raise UltraQuantError(f"tokenizer.ggml.pre: {pre!r} is not supported ({', '.join(PRE_TOKENIZERS)})")
        self.vocab = {tok: i for i, tok in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        if any(len(p) != 2 for p in pairs):
            raise UltraQuantError("tokens/merges: a merge is not two space-separated tokens")
        self._tok = Tokenizer(models.BPE(self.vocab, pairs))
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if pre == "smollm":
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        self._tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        self._tok.decoder = decoders.ByteLevel()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (for reports and debugging)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
