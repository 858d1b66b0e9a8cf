"""The offline byte-level tokenizer."""
import socket

import pytest
import torch

from vitgraph.text.tokenizer import EOT, PAD, SOT, VOCAB_SIZE, ByteTokenizer


def test_layout_start_end_pad():
    tok = ByteTokenizer(context_length=16)
    ids = tok(["a Red  star", "b"])
    assert ids.shape == (2, 16) and ids.dtype == torch.long
    row = ids[0].tolist()
    assert row[0] == SOT
    assert bytes(i - 1 for i in row[1:11]) == b"a red star"  # lower-cased, spaces collapsed
    assert row[11] == EOT and set(row[12:]) == {PAD}
    assert ids[1].tolist()[:3] == [SOT, ord("b") + 1, EOT]
    # end of text has the largest id: argmax finds it (CLIP's pooling convention)
    assert ids.argmax(dim=-1).tolist() == [11, 2]
    assert int(ids.max()) < VOCAB_SIZE


def test_truncation_keeps_end_of_text():
    tok = ByteTokenizer(context_length=8)
    ids = tok("a very long caption indeed")[0].tolist()
    assert len(ids) == 8 and ids[0] == SOT and ids[-1] == EOT
    assert tok.decode(ids) == "a very"


def test_round_trip_utf8_and_determinism():
    tok = ByteTokenizer(context_length=32)
    text = "un cœur rouge, à gauche"
    assert tok.decode(tok(text)[0]) == text
    assert torch.equal(tok([text, "x"]), ByteTokenizer(context_length=32)([text, "x"]))


def test_works_without_network(monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("the tokenizer tried to open a socket")
    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    assert ByteTokenizer(context_length=20)("a small blue circle").shape == (1, 20)


def test_context_length_too_small_is_refused():
    with pytest.raises(ValueError, match="context_length"):
        ByteTokenizer(context_length=2)


# ---------------------------------------------------------------- CLIP's BPE (open_clip's vocabulary)

BPE_TEXTS = ["a photo of a star.", "A large white STAR on a dark-blue background, in the top "
             "left, rotated 30 degrees!", "naïve café — 123 4567 &amp; don't", "", "x " * 100,
             "Hello, world!! 👍🏽 日本語", "<start_of_text> it's   spaced\tout\n"]


def test_bpe_gives_open_clips_ids_offline(monkeypatch):
    """The same ids as open_clip's own tokenizer (which pretrained CLIP text towers were
    trained on), with the network unreachable."""
    from conftest import import_open_clip
    from vitgraph.text import bpe
    if bpe.available():
        pytest.skip(f"needs {bpe.available()}")
    ref = import_open_clip().get_tokenizer("ViT-B-16")(BPE_TEXTS)

    def no_network(*a, **k):
        raise OSError("network disabled in this test")
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    tok = bpe.BPETokenizer(context_length=77)
    got = tok(BPE_TEXTS)
    assert torch.equal(got, ref)
    assert int(got.max()) == bpe.EOT == bpe.VOCAB_SIZE - 1  # argmax pooling finds end of text
    assert got[4, -1] == bpe.EOT  # cut to the context, ending in end of text
    assert tok.decode(got[1]) == "a large white star on a dark - blue background , in the top " \
                                 "left , rotated 3 0 degrees !"
    assert tok.decode(got[0]) == "a photo of a star ."


def test_auto_picks_bpe_for_clips_vocabulary_and_bytes_otherwise():
    from vitgraph.text import make_tokenizer
    from vitgraph.text import bpe
    assert isinstance(make_tokenizer("auto", 259, 128), ByteTokenizer)
    assert isinstance(make_tokenizer("auto", 32000, 64), ByteTokenizer)  # SigLIP's tower
    assert isinstance(make_tokenizer("byte", 49408, 77), ByteTokenizer)
    if not bpe.available():
        assert isinstance(make_tokenizer("auto", 49408, 77), bpe.BPETokenizer)
