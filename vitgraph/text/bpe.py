"""OpenAI CLIP's byte-pair-encoding tokenizer, read from the vocabulary open_clip ships inside
its package (``open_clip/bpe_simple_vocab_16e6.txt.gz``): nothing is downloaded. Pretrained
CLIP text towers (open_clip, Hugging Face ``CLIPModel``) only make sense with these ids.

Ids (49,408): the 256 byte symbols, the same 256 ending a word (``</w>``), one per merge in
file order, then start (49406) and end of text (49407), the largest id, so end-of-text pooling
may take ``argmax``. Padding is 0, as in open_clip. A sequence is ``[sot, ids..., eot, 0...]``
of ``context_length`` ids; a longer text is cut and its last id set to ``eot`` (open_clip's
rule). Text is cleaned as open_clip does: ftfy's repairs when ftfy is installed, HTML
entities unescaped, whitespace collapsed, lower case. Words are split with the ``regex``
package (Unicode letter / number classes), which open_clip also needs.
"""
from __future__ import annotations

import functools
import gzip
import html
import importlib.util
import os
from typing import Sequence

import torch

from vitgraph.text.tokenizer import Tokenizer

VOCAB_SIZE = 49408

SOT, EOT, PAD = VOCAB_SIZE - 2, VOCAB_SIZE - 1, 0
_NUM_MERGES = VOCAB_SIZE - 2 * 256 - 2  # the file holds more; CLIP used the first 48,894
_PATTERN = (r"""<start_of_text>|<end_of_text>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|"""
            r"""[^\s\p{L}\p{N}]+""")


def vocab_path() -> str | None:
    """open_clip's BPE vocabulary file, found without importing open_clip (None: not there)."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "bpe_simple_vocab_16e6.txt.gz")
    return path if os.path.exists(path) else None


def available() -> str | None:
    """None when the BPE tokenizer can be built here, else what is missing (for an error)."""
    if importlib.util.find_spec("regex") is None:
        return "the regex package (pip install -e .[clip])"
    if vocab_path() is None:
        return "open_clip's BPE vocabulary (pip install -e .[clip])"
    return None


def _byte_symbols() -> dict[int, str]:
    """Each byte as one printable character: printable Latin-1 bytes stand for themselves,
    the others (controls, space) take the code points from 256 up, in byte order. The dict's
    order is the vocabulary's: the printable ones first, then the others."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in keep}
    for n, b in enumerate(b for b in range(256) if b not in out):
        out[b] = chr(256 + n)
    return out


class BPETokenizer(Tokenizer):
    pad_id, sot_id, eot_id, vocab_size = PAD, SOT, EOT, VOCAB_SIZE

    def __init__(self, context_length: int = 77, path: str | None = None):
        super().__init__(context_length)
        missing = None if path else available()
        if missing:
            raise RuntimeError(f"the BPE tokenizer needs {missing}")
        import regex
        self._split = regex.compile(_PATTERN, regex.IGNORECASE)
        self._bytes = _byte_symbols()
        self._unbytes = {c: b for b, c in self._bytes.items()}
        with gzip.open(path or vocab_path(), "rt", encoding="utf-8") as f:
            lines = f.read().split("\n")[1:_NUM_MERGES + 1]  # line 0 is a version header
        merges = [tuple(line.split()) for line in lines]
        symbols = list(self._bytes.values())
        symbols += [s + "</w>" for s in symbols] + ["".join(m) for m in merges]
        symbols += ["<start_of_text>", "<end_of_text>"]
        assert len(symbols) == VOCAB_SIZE, len(symbols)
        self.encoder = {s: i for i, s in enumerate(symbols)}
        self.decoder = symbols
        self.ranks = {m: i for i, m in enumerate(merges)}
        self._bpe = functools.lru_cache(maxsize=65536)(self._merge)

    @staticmethod
    def _clean(text: str) -> str:
        try:
            import ftfy
            text = ftfy.fix_text(text)
        except ImportError:
            pass
        text = html.unescape(html.unescape(text))
        return " ".join(text.split()).lower()

    def _merge(self, word: str) -> tuple[str, ...]:
        """One word's symbols after applying merges, lowest rank first, until none applies."""
        parts = [*word[:-1], word[-1] + "</w>"]
        while len(parts) > 1:
            pairs = {(a, b) for a, b in zip(parts, parts[1:])}
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return tuple(parts)

    def encode(self, text: str) -> list[int]:
        """The ids of one text, unpadded: [sot, ids..., eot], cut to the context length."""
        ids = []
        for word in self._split.findall(self._clean(text)):
            if word in ("<start_of_text>", "<end_of_text>"):  # written out: the special id
                ids.append(self.encoder[word])
                continue
            word = "".join(self._bytes[b] for b in word.encode("utf-8"))
            ids += [self.encoder[s] for s in self._bpe(word)]
        ids = [SOT, *ids, EOT]
        if len(ids) > self.context_length:
            ids = ids[:self.context_length]
            ids[-1] = EOT
        return ids

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """The text of one id sequence, up to its end of text (padding is id 0, which is also
        "!": only what follows the end of text is padding)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        out = bytearray()
        for i in ids:
            if i == EOT:
                break
            if i == SOT:
                continue
            sym = self.decoder[i]
            end = sym.endswith("</w>")
            out += bytes(self._unbytes[c] for c in (sym[:-4] if end else sym))
            if end:
                out += b" "
        return out.decode("utf-8", errors="replace").strip()
