"""The task layer: one Trainer, a task supplies the model, the batch and the loss. Contrastive
(CLIP / SigLIP) training on CPU end to end, its config errors, and dp=2 against one process."""
import json

import pytest
import torch

from conftest import ROOT, loss_records, tiny_overrides
from vitgraph.cli import main

CLIP = ROOT / "configs" / "clip-tiny-shapes.yaml"
FAST = ["data.num_train=512", "data.num_val=200", "train.eval_batch_size=100",
        "model.num_layers=2"]


def log_of(run_dir):
    return [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_contrastive_training_end_to_end(tmp_path, capsys, loss):
    """Both losses train through the one loop: the loss falls, the held-out eval reports
    zero-shot top-1 and recall in both directions, metrics.json holds them and its path is
    printed. (In this process: the command-line path is the classification tests'.)"""
    run = tmp_path / "run"
    code = main(["train", str(CLIP), *tiny_overrides(
        run, steps=20, **{"train.eval_every": 10, "train.log_every": 10}), *FAST,
        f"task.loss={loss}"])
    out, err = capsys.readouterr()
    assert code == 0, out[-3000:] + err[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert "eval_top1" not in metrics  # a classifier's name: zero-shot is named so
    assert metrics["eval_images"] == 200
    for key in ("eval_zero_shot_top1", "eval_image_to_text_r@1", "eval_image_to_text_r@5",
                "eval_text_to_image_r@1", "eval_text_to_image_r@5"):
        hits = metrics[key] * 200  # a share of the 200 held-out images
        assert 0 <= round(hits) <= 200 and hits == pytest.approx(round(hits), abs=1e-3), key
    for way in ("image_to_text", "text_to_image"):
        assert metrics[f"eval_{way}_r@5"] >= metrics[f"eval_{way}_r@1"], metrics
    assert str((run / "metrics.json").resolve()) in out
    losses = {x["step"]: x["loss"] for x in log_of(run) if "loss" in x}
    assert losses[20] < losses[10], losses
    assert [x["step"] for x in log_of(run) if "eval_zero_shot_top1" in x] == [10, 20]
    assert f"({loss} loss)" in (run / "train.log").read_text()


@pytest.mark.parametrize("overrides,key,why", [
    (["model.name=clip_nope", "task.kind=contrastive"], "model.name", "unknown"),
    (["task.kind=contrastive", "model.name=vit_pico_patch4_32"], "model.name",
     "needs an image-text pair"),
    (["task.kind=classification"], "task.kind", "is an image-text pair"),
    (["task.context_length=500"], "task.context_length", "128 positions"),
    (["parallel.pp=2"], "parallel.pp", "one pipeline stage"),
    (["data.augment.enabled=true", "data.augment.preset=deit"], "data.augment.mixup_alpha",
     "mixup / cutmix"),
    (["task.templates=[a photo]"], "task.templates", "{}"),
    (["task.tokenizer=bpe"], "task.tokenizer", "49408 ids"),
    (["task.tokenizer=words"], "task.tokenizer", "auto, byte, bpe"),
    (["data.caption_dropout=1.5"], "data.caption_dropout", "[0, 1]"),
    (["data.caption_dropout_start=1"], "data.caption_dropout_start", "[0, 1)"),
    (["data.caption_dropout=0.5", "data.kind=imagefolder"], "data.caption_dropout",
     "only the shapes data"),
    (["data.caption_dropout=0.5", "data.captions=shape_first"], "data.caption_dropout",
     "data.captions=full or short"),
])
def test_contrastive_config_errors_exit_2(monkeypatch, capsys, overrides, key, why):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", str(CLIP), "train.micro_batch_size=32", *overrides]) == 2
    err = capsys.readouterr().err
    assert key in err and why in err, err


def test_caption_dropout_draw_is_seeded_and_eval_untouched():
    """One variant per pair, from (seed, step) over the global batch: the same step draws the
    same, another step or seed another, and a slice of the global batch (a rank's or a
    microbatch's share) gets the same draws as in the whole; size and colour each drop with
    probability p; eval (step None) and p=0 keep the caption as written."""
    from vitgraph.tasks.contrastive import draw_caption_variants
    b = 4000
    tokens = torch.arange(4).view(1, 4, 1).expand(b, 4, 3).contiguous()  # variant i -> id i
    a = draw_caption_variants(tokens, 0.5, seed=1, step=7)
    assert a.shape == (b, 3) and torch.equal(a[:, 0], a[:, 2])
    assert torch.equal(a, draw_caption_variants(tokens, 0.5, seed=1, step=7))
    for seed, step in [(2, 7), (1, 8)]:
        assert not torch.equal(a, draw_caption_variants(tokens, 0.5, seed, step))
    halves = [draw_caption_variants(tokens[:b // 2], 0.5, 1, 7, o, b) for o in (0, b // 2)]
    assert torch.equal(torch.cat(halves), a)
    freq = torch.bincount(a[:, 0], minlength=4).float() / b
    assert torch.allclose(freq, torch.full((4,), 0.25), atol=0.03), freq
    q = draw_caption_variants(tokens, 0.2, seed=1, step=7)[:, 0]
    size_dropped, colour_dropped = (q & 1).float().mean(), (q >> 1).float().mean()
    assert abs(size_dropped - 0.2) < 0.03 and abs(colour_dropped - 0.2) < 0.03
    assert (draw_caption_variants(tokens, 0.5, 1, None) == 0).all()
    assert (draw_caption_variants(tokens, 0.0, 1, 7) == 0).all()


def test_caption_dropout_in_the_task_starts_late_and_spares_held_out():
    """The task tokenizes every variant of the training captions and none of the held-out
    ones; before data.caption_dropout_start of the run (and for eval) a pair keeps its
    caption as written, after it the variants are drawn. The start-up log's model line says
    so, and its first step logs a line (the training loss jumps there)."""
    import logging
    import types

    from vitgraph.config import load_config
    from vitgraph.data import ImageDataset
    from vitgraph.data.shapes import caption_variants
    from vitgraph.tasks.contrastive import ContrastiveTask
    cfg = load_config(CLIP, ["data.caption_dropout=0.5", "data.caption_dropout_start=0.6",
                             "train.steps=100", "train.global_batch_size=64",
                             "train.micro_batch_size=64"])
    from vitgraph.plan import resolve
    d = types.SimpleNamespace(dp_rank=0, dp=1, tp=1, pp=1, vpp=1, device="cpu", cuda=False)
    task = ContrastiveTask(resolve(cfg, 1), d, total_steps=100)
    caps = ["a large white star", "a small dark blue L-shape"] * 32
    images = torch.zeros(64, 32, 32, 3, dtype=torch.uint8)
    labels = torch.zeros(64, dtype=torch.long)
    train = ImageDataset(images, labels, ["star"], caps,
                         caption_variants=[caption_variants(c) for c in caps])
    val = ImageDataset(images, labels, ["star"], caps)
    task.attach(train, val)
    assert train.tokens.shape == (64, 4, 32) and val.tokens.shape == (64, 32)
    assert torch.equal(train.tokens[:, 0], val.tokens)
    assert task._caption_dropout_line() == \
        "; caption dropout 0.5 after step 60 (data.caption_dropout_start 0.6)"
    said = []  # a handler of its own: a run in this process may have left one on the logger
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: said.append(r.getMessage())
    logger = logging.getLogger("vitgraph")
    level, logger.level = logger.level, logging.INFO
    logger.addHandler(handler)
    try:
        assert [task.caption_dropout(k) for k in [(59, 0), (60, 0), (60, 1), (61, 0),
                                                  None]] == [0.0, 0.5, 0.5, 0.5, 0.0]
    finally:
        logger.removeHandler(handler)
        logger.level = level
    said = [m for m in said if "caption dropout" in m]
    assert len(said) == 1 and "caption dropout 0.5 begins after step 60" in said[0], said
    texts = lambda toks: [task.tokenizer.decode(t) for t in toks]  # noqa: E731
    as_written = [c.lower() for c in caps]
    assert texts(task.prepare(train.fields(slice(0, 64)), (59, 0), "cpu", True)[1]) == as_written
    assert texts(task.prepare(train.fields(slice(0, 64)), None, "cpu", True)[1]) == as_written
    assert texts(task.prepare(val.fields(slice(0, 64)), None, "cpu", True)[1]) == as_written
    late = texts(task.prepare(train.fields(slice(0, 64)), (60, 0), "cpu", True)[1])
    assert "a star" in late and "a l-shape" in late and late != as_written


def test_contrastive_needs_captions(tmp_path, capsys):
    """An ImageFolder has labels but no captions: a data error (exit 2) that says so."""
    from PIL import Image
    for split in ("train", "val"):
        for c in ("a", "b"):
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(tmp_path / split / c / f"{i}.png")
    code = main(["train", str(CLIP), "data.kind=imagefolder", f"data.path={tmp_path}",
                 "data.caption_dropout=0",  # the shapes-only option of the config
                 f"run.dir={tmp_path / 'run'}", "train.global_batch_size=8",
                 "train.micro_batch_size=8"])
    assert code == 2
    assert "no captions" in capsys.readouterr().err


def launch_jobs(root) -> dict[int, list]:
    """This module's runs (conftest.launched): the same 6 steps of 32 pairs in one process
    and over two data-parallel ranks of 16."""
    def job(nproc, name):
        return name, {"args": [str(CLIP), *tiny_overrides(root / name, steps=6,
                                                          **{"train.log_every": 1}),
                               *FAST, "train.global_batch_size=32",
                               f"train.micro_batch_size={32 // nproc}"]}
    return {1: [job(1, "one")], 2: [job(2, "two")]}


@pytest.mark.multiproc
def test_contrastive_dp2_matches_one_process(launched):
    """Negatives gathered over data-parallel ranks: two ranks of 16 pairs follow one process
    of 32 (fp32, CPU, same seed), step for step."""
    one, two = ({x["step"]: (x["loss"], x["grad_norm"])
                 for x in loss_records(*launched[__name__][name])} for name in ("one", "two"))
    assert sorted(one) == sorted(two) == list(range(1, 7))
    for s in one:
        assert two[s][0] == pytest.approx(one[s][0], rel=1e-4), (s, one, two)
        assert two[s][1] == pytest.approx(one[s][1], rel=1e-3), (s, one, two)
