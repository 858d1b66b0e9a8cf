"""Native resolution end to end on CPU: packed training through the Trainer at every layout
(torchrun, gloo, fp32) on one process's loss curve, an exact resume, the eval in packs, padded
slots (data.packing.layout=padded), and the torch spec's segment attention against a
block-diagonal mask."""
import json

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, loss_records, tiny_overrides

NATIVE = str(ROOT / "configs" / "vit-tiny-shapes-native.yaml")
# 2 packs a step (one per rank at dp=2) of 512 tokens, images of at most 48 patches
PACKS = ["train.global_batch_size=2", "data.packing.tokens_per_microbatch=512",
         "data.packing.max_patches=48", "data.packing.max_images=16",
         "data.packing.layout=packed"]
STEPS = 6


def run_args(run_dir, *extra: str) -> list[str]:
    return [NATIVE, *tiny_overrides(run_dir, steps=STEPS, **{"train.log_every": 1,
                                                              "data.num_train": 256,
                                                              "data.num_val": 64}),
            *PACKS, *extra]


def losses(run_dir, launch=None) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in loss_records(run_dir, launch)}


LAYOUTS = {
    "dp2": [],
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pp=2"],
    "pp2-step-graphs": ["parallel.pp=2", "graphs.enabled=true", "graphs.scope=step",
                        "graphs.warmup_steps=2"],
}


# data.augment on: the crop (in the resize), flip, RandAugment's colour ops, colour jitter and
# random erasing, all but the crop in the classifier's step
AUGMENT = ["data.augment.enabled=true", "data.augment.preset=deit", "data.augment.mixup_alpha=0",
           "data.augment.cutmix_alpha=0", "data.augment.color_jitter=0.2",
           "data.augment.erase_prob=0.5"]
STEP_GRAPHS = ["graphs.enabled=true", "graphs.scope=step", "graphs.warmup_steps=1"]


def launch_jobs(root) -> dict[int, list]:
    """This module's runs (conftest.launched): in one process the one-process run (saved at
    step 3 too) and its copy stopped after step 3 and resumed, the same pair with
    augmentation (resumed with step graphs); the layouts at two."""
    return {1: [("one", {"args": run_args(root / "one", "checkpoint.every=3",
                                          "checkpoint.keep=5")}),
                ("resumed", {"args": run_args(root / "resumed"),
                             "resume": {"from": str(root / "one"), "step": 3}}),
                ("augmented", {"args": run_args(root / "augmented", *AUGMENT,
                                                "checkpoint.every=3", "checkpoint.keep=5")}),
                ("augmented-resumed", {"args": run_args(root / "augmented-resumed", *AUGMENT,
                                                        *STEP_GRAPHS),
                                       "resume": {"from": str(root / "augmented"), "step": 3}}),
                ("padded", {"args": run_args(root / "padded", "data.packing.layout=padded",
                                             "train.steps=3")})],
            2: [(name, {"args": run_args(root / name, *extra)}) for name, extra in LAYOUTS.items()]}


@pytest.fixture(scope="module")
def runs(launched):
    return launched[__name__]


@pytest.fixture(scope="module")
def reference(runs):
    return losses(runs["one"][0])


def same_curve(got, ref, steps=range(1, STEPS + 1)):
    steps = list(steps)
    assert sorted(ref) == list(range(1, STEPS + 1)), sorted(ref)  # log_every=1
    assert sorted(got) == steps, (sorted(got), steps)
    for s in steps:
        assert got[s] == pytest.approx(ref[s], rel=2e-4), (s, got, ref)


def test_a_native_run_trains_in_packs_and_reports_them(runs):
    run_dir = runs["one"][0]
    train = loss_records(run_dir)
    assert len(train) == STEPS and all(r["real_tokens_per_s"] > 0 for r in train)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["eval_images"] == 64  # every held-out image once, in packs
    log = (run_dir / "train.log").read_text()
    assert "packs of 512 tokens" in log
    # the batch counts packs, not images
    assert "global batch 2 packs = 2 microbatches x 1 x dp 1" in log


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_native_layouts_match_one_process(runs, reference, name):
    same_curve(losses(*runs[name]), reference)


def test_a_padded_native_run_trains_in_slots(runs):
    """data.packing.layout=padded: each image in a slot of 49 tokens, 10 a microbatch; the
    run trains and evaluates every held-out image, and says which layout and why."""
    run_dir = runs["padded"][0]
    train = loss_records(run_dir)
    assert len(train) == 3 and all(r["loss"] == r["loss"] for r in train)
    assert json.loads((run_dir / "metrics.json").read_text())["eval_images"] == 64
    log = (run_dir / "train.log").read_text()
    assert "packs of 490 tokens (padded: at most 10 images" in log
    assert "global batch 2 packs = 2 microbatches x 1 x dp 1" in log
    assert "packing: padded (data.packing.layout=padded in the config)" in log


def test_a_resumed_native_run_packs_as_before(runs, reference):
    """Stopped after step 3 (its checkpoint kept, the later one removed), resumed: steps 4-6
    are the uninterrupted run's (the packer's carry-over is in the checkpoint)."""
    same_curve(losses(runs["resumed"][0]), reference, steps=[4, 5, 6])


def test_segment_attention_equals_a_block_diagonal_mask():
    from vitgraph.models.packed import block_diagonal, segment_attention
    torch.manual_seed(0)
    T, h, d, L = 40, 2, 8, 12
    cu = torch.tensor([0, 5, 17, 17, 29, 33, 40, 40], dtype=torch.int32)  # an empty segment
    q, k, v = (torch.randn(T, h, d, requires_grad=True) for _ in range(3))
    got = segment_attention(q, k, v, cu, L)
    keep = block_diagonal(cu, T)
    ref = F.scaled_dot_product_attention(*(t.permute(1, 0, 2) for t in (q, k, v)),
                                         attn_mask=keep).permute(1, 0, 2)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(got)
    grads = torch.autograd.grad(got, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_segment_attention_rows_leave_the_later_segments_out():
    """rows=3: the first three segments' tokens as before, the rest (a pack's padding runs)
    zeros."""
    from vitgraph.models.packed import segment_attention
    torch.manual_seed(1)
    cu = torch.tensor([0, 5, 17, 17, 29, 33, 40, 40], dtype=torch.int32)
    q, k, v = (torch.randn(40, 2, 8) for _ in range(3))
    full = segment_attention(q, k, v, cu, 12)
    cut = segment_attention(q, k, v, cu, 12, rows=3)
    torch.testing.assert_close(cut[:17], full[:17])
    assert cut[17:].abs().max() == 0


def test_a_native_runs_timm_export_is_naflexvit(runs, tmp_path, capsys):
    """``vitgraph export --format timm`` of a native run writes timm's NaFlexVit: its
    config.json builds the model and the weights load strictly."""
    timm = pytest.importorskip("timm")
    from safetensors.torch import load_file
    from vitgraph.cli import main
    out = tmp_path / "model.safetensors"
    assert main(["export", str(runs["one"][0]), "--format", "timm", "--out", str(out)]) == 0, \
        capsys.readouterr().err[-2000:]
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architecture"].startswith("naflexvit")
    model = timm.create_model(cfg["architecture"], pretrained=False,
                              num_classes=cfg["num_classes"], **cfg["model_args"])
    model.load_state_dict(load_file(str(out)), strict=True)


def test_augmented_native_steps_in_a_step_graph_resume_onto_the_eager_curve(runs, reference):
    """data.augment at native resolution runs in the classifier's step (PackAugment.apply in
    its forward): the run stopped after step 3 and resumed with graphs.scope=step (the CPU
    rerun backend: step 4 eager, step 5 captured, step 6 replayed with its pack and drawn
    parameters copied into the graph's inputs) trains the eager run's steps 4-6 exactly (the
    draws are keyed by step and microbatch, the crops by epoch and image)."""
    eager = losses(runs["augmented"][0])
    assert sorted(eager) == list(range(1, STEPS + 1))
    assert eager != reference  # the augmentation changed the images
    log = (runs["augmented"][0] / "train.log").read_text()
    assert "flip 0.5, randaugment 2 ops m9 (std 0.5, p 0.5), colour jitter 0.2, erasing 0.5" \
        in log
    resumed = loss_records(runs["augmented-resumed"][0])
    assert resumed[-1]["graphs_replays"] > 0
    assert {r["step"]: r["loss"] for r in resumed} == {s: eager[s] for s in (4, 5, 6)}
