"""Zero-shot and retrieval metrics on hand-made features."""
import pytest
import torch
import torch.nn.functional as F

from vitgraph.tasks.contrastive_metrics import class_embeddings, retrieval_recall, zero_shot_top1
from vitgraph.text.tokenizer import ByteTokenizer


def test_retrieval_recall_by_hand():
    e = torch.eye(4)
    # text 0 <-> image 0 and text 1 <-> image 1 right; texts 2 and 3 swapped
    txt = e[[0, 1, 3, 2]]
    r = retrieval_recall(e, txt, ks=(1, 2))
    assert r["image_to_text_r@1"] == 0.5 and r["text_to_image_r@1"] == 0.5
    # the swapped ones: their true partner scores 0, tied with two others -> rank 3
    assert r["image_to_text_r@2"] == 0.5
    assert retrieval_recall(e, e, ks=(1,)) == {"image_to_text_r@1": 1.0, "text_to_image_r@1": 1.0}


def test_retrieval_is_directional():
    img = F.normalize(torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]]), dim=-1)
    txt = F.normalize(torch.tensor([[1.0, 0.2], [1.0, 0.0], [0.0, 1.0]]), dim=-1)
    r = retrieval_recall(img, txt, ks=(1,))
    # image 0 is nearest to text 1 (wrong), image 1 to text 0 (wrong), image 2 right
    assert r["image_to_text_r@1"] == pytest.approx(1 / 3)
    # text 0 finds image 1 (wrong)... text 1 finds image 0 (wrong), text 2 image 2
    assert r["text_to_image_r@1"] == pytest.approx(1 / 3)


def test_class_embeddings_average_templates_and_zero_shot():
    tok = ByteTokenizer(40)
    seen = []

    def encode(ids):  # a fake text tower: the class is read off one byte of the prompt
        seen.append(ids.shape[0])
        feats = torch.zeros(ids.shape[0], 3)
        for i, row in enumerate(ids):
            text = tok.decode(row)
            feats[i, 0 if "star" in text else 1 if "circle" in text else 2] = 1.0
            feats[i, 2] += 0.1 * len(text) / 40  # template-dependent part, averaged away
        return feats
    classes = class_embeddings(encode, tok, ["star", "circle"], templates=("a {}.", "a big {}!"))
    assert seen == [2, 2] and classes.shape == (2, 3)
    assert torch.allclose(classes.norm(dim=-1), torch.ones(2))
    images = F.normalize(torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.1, 0.0]]), dim=-1)
    assert zero_shot_top1(images, classes, torch.tensor([0, 1, 0])) == 1.0
    assert zero_shot_top1(images, classes, torch.tensor([1, 1, 1])) == pytest.approx(1 / 3)


def test_retrieval_counts_an_identical_caption_as_the_own_one():
    """Pairs 0 and 1 have the same caption and alike images: each finding the other's text
    (or image) first is a hit when the ids say the captions are equal, a tie lost otherwise."""
    img = torch.eye(3)[[0, 0, 2]]
    txt = torch.eye(3)[[0, 0, 2]]
    assert retrieval_recall(img, txt, ks=(1,)) == pytest.approx(
        {"image_to_text_r@1": 1 / 3, "text_to_image_r@1": 1 / 3})
    same = torch.tensor([[5, 6], [5, 6], [7, 8]])
    assert retrieval_recall(img, txt, ks=(1,), tokens=same) == {
        "image_to_text_r@1": 1.0, "text_to_image_r@1": 1.0}
    other = torch.tensor([[5, 6], [5, 9], [7, 8]])  # different captions: back to ties lost
    assert retrieval_recall(img, txt, ks=(1,), tokens=other) == pytest.approx(
        {"image_to_text_r@1": 1 / 3, "text_to_image_r@1": 1 / 3})
