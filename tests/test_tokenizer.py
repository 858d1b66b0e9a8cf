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


# ---------------------------------------------------------------- transformers tokenizers (hf:)

HF_TEXTS = ["star, large white", "circle, small dark blue", "a large white star", "l-shape"]


def test_hf_tokenizer_lays_out_bos_caption_eos_pad_offline(tmp_path, monkeypatch):
    from conftest import write_hf_tokenizer
    from vitgraph.text import make_tokenizer, tokenizer_vocab_size
    folder = write_hf_tokenizer(tmp_path / "tok", HF_TEXTS, bos_token="<s>", eos_token="</s>",
                                pad_token="<pad>")

    def no_network(*a, **k):
        raise OSError("network disabled in this test")
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    tok = make_tokenizer(f"hf:{folder}", 0, 8)
    ref = tok.tok
    assert (tok.sot_id, tok.eot_id, tok.pad_id) == (ref.bos_token_id, ref.eos_token_id,
                                                     ref.pad_token_id)
    assert tok.vocab_size == len(ref) == tokenizer_vocab_size(f"hf:{folder}")
    ids = tok(["star, large white", "a large white star on a dark blue circle, small"])
    body = ref("star, large white", add_special_tokens=False)["input_ids"]
    assert ids[0].tolist()[:len(body) + 2] == [tok.sot_id, *body, tok.eot_id]
    assert set(ids[0].tolist()[len(body) + 2:]) <= {tok.pad_id}
    assert ids[1, 0] == tok.sot_id and ids[1, -1] == tok.eot_id  # cut, ending in EOS
    assert tok.decode(ids[0]) == "star, large white"


def test_hf_tokenizer_without_special_tokens_gets_them_added(tmp_path):
    """No BOS / EOS: <|bos|> and <|eos|> are added after the vocabulary; no pad: EOS pads.
    GPT-2's layout (BOS = EOS) loses no target: the loss starts after BOS."""
    from conftest import write_hf_tokenizer
    from vitgraph.tasks.caption import IGNORE, text_targets
    from vitgraph.text.hf import ADDED_BOS, ADDED_EOS, HFTokenizer
    bare = write_hf_tokenizer(tmp_path / "bare", HF_TEXTS, unk_token="<unk>")
    tok = HFTokenizer(str(bare), 12)
    assert tok.tok.convert_ids_to_tokens([tok.sot_id, tok.eot_id]) == [ADDED_BOS, ADDED_EOS]
    assert tok.vocab_size == len(tok.tok) and tok.eot_id >= tok.vocab_size - 2
    assert tok.pad_id == tok.eot_id
    gpt2 = HFTokenizer(str(write_hf_tokenizer(tmp_path / "gpt2", HF_TEXTS,
                                              bos_token="<|endoftext|>",
                                              eos_token="<|endoftext|>")), 12)
    assert gpt2.sot_id == gpt2.eot_id == gpt2.pad_id
    ids = gpt2(["l-shape"])
    n = len(gpt2.encode("l-shape")) - 1  # the caption's ids and EOS
    targets = text_targets(ids, gpt2.eot_id)
    assert (targets[0, :n] != IGNORE).all() and (targets[0, n:] == IGNORE).all()


@pytest.mark.parametrize("missing", ["name", "transformers"])
def test_hf_tokenizer_not_here_is_a_config_error(tmp_path, monkeypatch, missing):
    from conftest import ROOT
    from vitgraph.config import ConfigError, load_config
    from vitgraph.text import hf
    name = str(tmp_path / "nowhere")
    if missing == "transformers":
        find = hf.importlib.util.find_spec
        monkeypatch.setattr(hf.importlib.util, "find_spec",
                            lambda n, *a: None if n == "transformers" else find(n, *a))
    hf.load.cache_clear()
    with pytest.raises(ConfigError, match="lm.tokenizer") as e:
        load_config(ROOT / "configs" / "vlm-tiny-shapes.yaml", [f"lm.tokenizer=hf:{name}"])
    assert ("pip install transformers" if missing == "transformers" else
            "local Hugging Face cache") in str(e.value)
