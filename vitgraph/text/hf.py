"""A Hugging Face ``transformers`` tokenizer for a caption run's language model
(``lm.tokenizer: hf:<name or folder>``), read offline: ``AutoTokenizer.from_pretrained(name,
local_files_only=True)``, so a hub name must already be in the local Hugging Face cache and
a folder must hold the tokenizer's files (``save_pretrained``'s). Nothing is downloaded.

Its ids as vitgraph's tokenizers lay them out, ``[BOS, caption..., EOS, pad...]`` of
``context_length`` ids, the caption's own ids without the tokenizer's special tokens, a long
caption cut keeping EOS. BOS is the tokenizer's ``bos_token`` (else its ``cls_token``), EOS its
``eos_token`` (else its ``sep_token``); a tokenizer with neither gets ``<|bos|>`` /
``<|eos|>`` added as special tokens, new ids after its vocabulary. Padding is its
``pad_token``, else EOS (the loss ignores everything after the first EOS). BOS may be EOS (GPT-2's
``<|endoftext|>`` is both). The vocabulary, added tokens included, is the language model's.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Sequence

import torch

from vitgraph.text.tokenizer import Tokenizer

PREFIX = "hf:"
ADDED_BOS, ADDED_EOS = "<|bos|>", "<|eos|>"


def hf_name(kind: str) -> str | None:
    """The name or folder of an ``hf:<name>`` tokenizer setting; None for another kind."""
    return kind[len(PREFIX):] if kind.startswith(PREFIX) else None


def problem(name: str) -> str | None:
    """Why the tokenizer ``name`` cannot be loaded here (for a config error), or None."""
    try:
        load(name)
    except RuntimeError as e:
        return str(e)
    return None


@functools.lru_cache(maxsize=8)
def load(name: str):
    """The transformers tokenizer ``name`` (a hub name in the local cache, or a folder) with
    BOS and EOS (added where it has none); RuntimeError saying what is missing."""
    if importlib.util.find_spec("transformers") is None:
        raise RuntimeError("needs the transformers package (pip install transformers)")
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception as e:  # (OSError when not there; other types from a broken folder)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"no tokenizer {name!r} in the local Hugging Face cache or as a "
                           f"folder (nothing is downloaded: fetch it first, e.g. `hf "
                           f"download {name}`, or save_pretrained it to a folder; "
                           f"{type(e).__name__}: {first})") from None
    added = {}
    if tok.bos_token_id is None and tok.cls_token_id is None:
        added["bos_token"] = ADDED_BOS
    if tok.eos_token_id is None and tok.sep_token_id is None:
        added["eos_token"] = ADDED_EOS
    if added:
        tok.add_special_tokens(added)
    return tok


class HFTokenizer(Tokenizer):
    """vitgraph's tokenizer interface (``encode``, ``decode``, a batch call, ``sot_id``,
    ``eot_id``, ``pad_id``, ``vocab_size``) over a transformers tokenizer."""

    def __init__(self, name: str, context_length: int):
        super().__init__(context_length)
        self.name = name
        self.tok = load(name)
        t = self.tok
        self.sot_id = t.bos_token_id if t.bos_token_id is not None else t.cls_token_id
        self.eot_id = t.eos_token_id if t.eos_token_id is not None else t.sep_token_id
        self.pad_id = t.pad_token_id if t.pad_token_id is not None else self.eot_id
        self.vocab_size = len(t)

    def encode(self, text: str) -> list[int]:
        """[BOS, ids..., EOS], cut to the context length keeping EOS."""
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return [self.sot_id, *ids[: self.context_length - 2], self.eot_id]

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """The text of one id sequence: special tokens and padding dropped."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.tok.decode(ids, skip_special_tokens=True).strip()
