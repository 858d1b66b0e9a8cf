"""Text side of image–text training: the offline tokenizers (the text tower lives in
vitgraph.models.text). ``byte``: vitgraph's own byte-level one (any tower with >= 259 ids);
``bpe``: OpenAI CLIP's BPE from open_clip's packaged vocabulary (towers with its 49,408 ids,
which pretrained CLIP weights need); ``hf:<name or folder>``: a transformers tokenizer read
offline (a caption run's language model, vitgraph.text.hf)."""
from vitgraph.text.bpe import VOCAB_SIZE as BPE_VOCAB_SIZE
from vitgraph.text.bpe import BPETokenizer
from vitgraph.text.hf import HFTokenizer, hf_name
from vitgraph.text.tokenizer import VOCAB_SIZE as BYTE_VOCAB_SIZE
from vitgraph.text.tokenizer import ByteTokenizer


def tokenizer_kind(kind: str, vocab_size: int) -> str:
    """task.tokenizer with auto resolved: bpe for a tower with CLIP's vocabulary, else byte."""
    if kind != "auto":
        return kind
    return "bpe" if vocab_size == BPE_VOCAB_SIZE else "byte"


def make_tokenizer(kind: str, vocab_size: int, context_length: int):
    if hf_name(kind):
        return HFTokenizer(hf_name(kind), context_length)
    if tokenizer_kind(kind, vocab_size) == "bpe":
        return BPETokenizer(context_length)
    return ByteTokenizer(context_length)


def tokenizer_vocab_size(kind: str) -> int:
    """The ids of tokenizer ``kind`` (bpe, byte or hf:<name>: loads it)."""
    if hf_name(kind):
        return HFTokenizer(hf_name(kind), 3).vocab_size
    return BPE_VOCAB_SIZE if kind == "bpe" else BYTE_VOCAB_SIZE
