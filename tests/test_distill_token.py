"""DeiT's distillation token (model.distill_token): the model's two heads, timm's
VisionTransformerDistilled weights in and out (its eval logits, its config.json), the task's
split of the heads (class head: the task loss; distillation head: the teacher's; their average
otherwise), short CPU runs, and the layouts it cannot serve as config errors."""
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, world_of_one
from test_convert import build, randomise, rel_err
from vitgraph.config import ConfigError, load_config
from vitgraph.convert import export_state_dict, from_vitgraph, init_from

TINY = ROOT / "configs" / "vit-tiny-shapes.yaml"
dist1 = world_of_one("torch")
DEIT = ["model.distill_token=true"]


def _timm_deit(num_classes=5):
    import timm
    return randomise(timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False,
                                       num_classes=num_classes, img_size=32, patch_size=4,
                                       embed_dim=64, depth=4, num_heads=4)).eval()


def test_the_model_has_a_second_prefix_token_and_head(dist1):
    model = build(dist1, *DEIT, num_classes=7)
    names = dict(model.named_parameters())
    assert names["dist_token"].shape == (1, 1, 64)
    assert names["head_dist.weight"].shape == (7, 64)
    assert model.num_prefix == 2 and model.seq_len == 2 + 64
    assert names["pos_embed"].shape[1] == 66
    out = model(torch.randn(3, 3, 32, 32))
    assert out.shape == (3, 2, 7)
    # both heads start at zero, as the class head does; the tokens from the seeded init
    assert torch.equal(out, torch.zeros_like(out))
    assert names["dist_token"].abs().sum() > 0
    again = build(dist1, *DEIT, num_classes=7)
    assert torch.equal(again.dist_token, model.dist_token)
    assert not torch.equal(model.dist_token, model.cls_token)


def test_timm_distilled_weights_in_and_out(dist1, tmp_path):
    """timm's eval output (the two heads' average) from vitgraph's two heads; the export
    loads back into timm strictly."""
    ref = _timm_deit()
    src = tmp_path / "deit.pth"
    torch.save(ref.state_dict(), src)
    ours = build(dist1, *DEIT, "model.init_std=0.02", num_classes=5)
    report = init_from(ours, str(src))
    assert not report["head_reinitialised"]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        both = ours(x)
        assert rel_err(both.mean(dim=1), ref(x)) <= 1e-4
        # each head on its own token
        feats = ref.forward_features(x)
        assert rel_err(both[:, 0], ref.head(feats[:, 0])) <= 1e-4
        assert rel_err(both[:, 1], ref.head_dist(feats[:, 1])) <= 1e-4
    back = _timm_deit()
    back.load_state_dict(from_vitgraph(export_state_dict(ours), "timm", num_heads=4), strict=True)
    with torch.no_grad():
        assert rel_err(back(x), ref(x)) <= 1e-6


def test_timm_config_of_a_distilled_run_rebuilds_it(dist1):
    import timm

    from vitgraph.convert import export_files
    from vitgraph.convert.tables import ConvertError
    from vitgraph.models.registry import resolve_arch
    cfg = load_config(TINY, ["model.spec=torch", *DEIT])
    ours = randomise(build(dist1, *DEIT, num_classes=3), seed=3)
    side = export_files.timm_config(cfg.model.name, resolve_arch(cfg.model), cfg.model, 3, None)
    assert side["architecture"] == "deit_base_distilled_patch16_224"
    assert side["pretrained_cfg"]["classifier"] == ["head", "head_dist"]
    ref = timm.create_model(side["architecture"], pretrained=False,
                            num_classes=side["num_classes"], **side["model_args"]).eval()
    ref.load_state_dict(from_vitgraph(export_state_dict(ours), "timm", num_heads=4), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert rel_err(ref(x), ours(x).mean(dim=1)) <= 1e-4
    regs = load_config(TINY, ["model.spec=torch", *DEIT, "model.num_registers=2"])
    with pytest.raises(ConvertError, match="register"):
        export_files.timm_config(regs.model.name, resolve_arch(regs.model), regs.model, 3, None)


def test_weights_without_the_token_name_it(dist1, tmp_path):
    """A plain ViT's weights into a distilled model, and the other way round: the key named."""
    import timm

    from vitgraph.convert.tables import ConvertError
    plain = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5,
                              img_size=32, patch_size=4, embed_dim=64, depth=4, num_heads=4)
    torch.save(plain.state_dict(), tmp_path / "plain.pth")
    with pytest.raises(ConvertError, match="dist_token"):
        init_from(build(dist1, *DEIT, num_classes=5), str(tmp_path / "plain.pth"))
    torch.save(_timm_deit().state_dict(), tmp_path / "deit.pth")
    with pytest.raises(ConvertError, match="dist_token.*model.distill_token"):
        init_from(build(dist1, num_classes=5), str(tmp_path / "deit.pth"))


def _task(**distill):
    from vitgraph.plan import resolve
    from vitgraph.tasks.classification import ClassificationTask
    cfg = load_config(TINY, [*DEIT, "train.label_smoothing=0.1",
                             *(f"train.distill.{k}={v}" for k, v in distill.items())])
    task = ClassificationTask.__new__(ClassificationTask)
    task.plan, task.pack = resolve(cfg, 1), None
    return task


def test_the_heads_take_their_own_losses_with_a_teacher_and_average_without():
    g = torch.Generator().manual_seed(0)
    both = torch.randn(4, 2, 5, generator=g)
    teacher = torch.randn(4, 5, generator=g)
    labels = torch.tensor([0, 1, 2, 4])
    from vitgraph.tasks.distill import hard_loss, soft_loss
    ce_cls = F.cross_entropy(both[:, 0], labels, label_smoothing=0.1)
    for kind, w, temp in (("hard", 0.5, 1.0), ("soft", 0.3, 2.0)):
        task = _task(teacher="timm:x", kind=kind, weight=w, temperature=temp)
        loss, stats = task.loss((None, labels, labels, teacher), both)
        term = hard_loss(both[:, 1], teacher) if kind == "hard" \
            else soft_loss(both[:, 1], teacher, temp)
        assert loss.item() == pytest.approx(((1 - w) * ce_cls + w * term).item(), rel=1e-6)
        assert stats[3].item() == pytest.approx(4 * ce_cls.item(), rel=1e-6)
        assert stats[4].item() == pytest.approx(4 * term.item(), rel=1e-6)
        # top-1 from the heads' average
        want = (both.mean(dim=1).argmax(-1) == labels).sum().item()
        assert stats[1].item() == want
    # no teacher logits (evaluation, or training without a teacher): the average's loss
    plain = _task()
    loss, stats = plain.loss((None, labels, labels), both)
    avg = both.mean(dim=1)
    assert loss.item() == pytest.approx(F.cross_entropy(avg, labels, label_smoothing=0.1).item(),
                                        rel=1e-6)
    assert stats[1].item() == (avg.argmax(-1) == labels).sum().item()


RUN = ["train.log_every=1", "train.eval_every=0", "train.tensorboard=false",
       "train.progress=false", "data.num_train=64", "data.num_val=32",
       "train.global_batch_size=16", "train.micro_batch_size=8", "model.spec=torch"]


def _train(run_dir, steps, *extra):
    from vitgraph.train.loop import train
    return train(load_config(TINY, [*RUN, f"train.steps={steps}", f"run.dir={run_dir}", *extra]))


def _records(run_dir):
    lines = (Path(run_dir) / "log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_short_runs_with_and_without_a_teacher(tmp_path):
    # without a teacher: both heads learn the labels through their average
    m = _train(tmp_path / "alone", 4, *DEIT)
    assert m["step"] == 4 and "eval_top1" in m
    losses = [r["loss"] for r in _records(tmp_path / "alone")]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses
    # a distilled run as the teacher (its two heads averaged), hard distillation, mixed targets
    m = _train(tmp_path / "student", 3, *DEIT, f"train.distill.teacher={tmp_path / 'alone'}",
               "train.distill.kind=hard", "data.augment.enabled=true",
               "data.augment.preset=deit", "data.augment.mix_prob=1.0")
    records = _records(tmp_path / "student")
    assert m["step"] == 3 and records
    for r in records:
        assert r["loss"] == pytest.approx(0.5 * r["loss_task"] + 0.5 * r["loss_distill"], rel=1e-5)
    # its checkpoint resumes with the token and both heads
    m = _train(tmp_path / "alone", 6, *DEIT)
    assert m["step"] == 6


@pytest.mark.parametrize("config,over,words", [
    ("vit-tiny-shapes", ["model.pool=mean"], "model.class_token=true and model.pool=cls"),
    ("vit-tiny-shapes", ["model.class_token=false", "model.pool=mean"], "model.class_token=true"),
    ("vit-tiny-shapes-native", [], "data.resolution=native"),
    ("clip-tiny-shapes", [], "task.kind=classification"),
])
def test_layouts_it_cannot_serve_are_config_errors(config, over, words):
    with pytest.raises(ConfigError, match=f"model.distill_token=True.*{words}"):
        load_config(ROOT / "configs" / f"{config}.yaml", [*DEIT, *over])
