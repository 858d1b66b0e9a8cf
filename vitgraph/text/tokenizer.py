"""A byte-level tokenizer: nothing to download, nothing fetched at run time, deterministic.

Each UTF-8 byte of the (lower-cased, whitespace-collapsed) text is one token. The ids are laid
out so that the end-of-text token has the largest id, as in OpenAI CLIP's BPE vocabulary, so
end-of-text pooling may take ``argmax`` of the ids:

    0          pad
    1 .. 256   the bytes 0x00 .. 0xff
    257        start of text
    258        end of text             (vocab_size = 259)

A sequence is ``[sot, bytes..., eot, pad...]`` of exactly ``context_length`` ids. A text longer
than ``context_length - 2`` bytes is cut, and its last id is still ``eot`` (as open_clip does).
Byte-level sequences are longer than BPE ones; for the short captions of the embedded shapes
data (under 100 bytes) that is cheap. Pretrained CLIP text towers need their own BPE
vocabulary (open_clip ships one inside its package); that tokenizer is not part of this module.
"""
from __future__ import annotations

from typing import Sequence

import torch

PAD, BYTE_OFFSET, SOT, EOT = 0, 1, 257, 258
VOCAB_SIZE = 259


class Tokenizer:
    """What every vitgraph tokenizer shares: a fixed context length (>= 3: start, one token,
    end of text) and padding a batch of ``encode``d texts to it with ``pad_id``."""
    pad_id: int

    def __init__(self, context_length: int):
        if context_length < 3:
            raise ValueError(f"context_length={context_length}: needs room for start, one token "
                             "and end of text (>= 3)")
        self.context_length = context_length

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def __call__(self, texts: str | Sequence[str]) -> torch.Tensor:
        """int64 [n, context_length] (a single string gives n = 1)."""
        if isinstance(texts, str):
            texts = [texts]
        out = torch.full((len(texts), self.context_length), self.pad_id, dtype=torch.long)
        for i, t in enumerate(texts):
            ids = self.encode(t)
            out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out


class ByteTokenizer(Tokenizer):
    pad_id, sot_id, eot_id, vocab_size = PAD, SOT, EOT, VOCAB_SIZE

    def __init__(self, context_length: int = 77, lower: bool = True):
        super().__init__(context_length)
        self.lower = lower

    def _clean(self, text: str) -> str:
        text = " ".join(text.split())
        return text.lower() if self.lower else text

    def encode(self, text: str) -> list[int]:
        """The ids of one text, unpadded: [sot, bytes..., eot], cut to the context length."""
        body = [b + BYTE_OFFSET for b in self._clean(text).encode("utf-8")]
        return [SOT, *body[: self.context_length - 2], EOT]

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """The text of one id sequence: special tokens and padding dropped."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < SOT)
        return data.decode("utf-8", errors="replace")
