"""GPU: graphs.scope=step -- the whole training step as one CUDA graph -- gives what the same
step gives eagerly (loss, grad norm, parameters after 20 steps), on one GPU and on two
(torchrun, dp=2), and a checkpoint load captures again and continues the same curve."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, clean_env, free_port

from test_train_gpu import make_trainer

pytestmark = pytest.mark.gpu

STEP = ["graphs.enabled=true", "graphs.scope=step"]
TWO_MICROBATCHES = ["train.global_batch_size=16", "train.micro_batch_size=8"]


def data(step):
    g = torch.Generator().manual_seed(step)
    return [(torch.randint(0, 256, (8, 224, 224, 3), dtype=torch.uint8, generator=g),
             torch.randint(0, 10, (8,), generator=g)) for _ in range(2)]


def run_steps(t, first, last):
    """Steps first+1 .. last as the loop runs them: (loss, grad norm) per step."""
    out = []
    for s in range(first, last):
        t.step = s
        t.graphs.step_begin(s)
        r = t.train_step(data(s))
        assert bool(r.ok)
        out.append(((r.stats[0] / r.stats[2]).item(), float(r.grad_norm)))
    t.step = last
    return out


def params(t):
    return [p.detach().float().clone() for c in t.chunks for p in c.parameters()]


# both layer kinds: auto picks megatron's layer for these small micro-batches
@pytest.mark.parametrize("fused_norm", ["never", "always"])
def test_step_graphs_equal_eager_on_one_gpu(tmp_path, fused_norm):
    runs = {}
    for name, over in {"eager": [], "step-eager": [*STEP, "graphs.warmup_steps=1000"],
                       "step-graphs": [*STEP, "graphs.warmup_steps=3"]}.items():
        t = make_trainer(tmp_path / name, *TWO_MICROBATCHES, *over,
                         f"model.fused_norm={fused_norm}")
        try:
            runs[name] = (run_steps(t, 0, 20), params(t), t.graphs.stats() if t.graphs else None)
        finally:
            t.close(shutdown_dist=False)
    curve, weights, stats = runs["step-graphs"]
    assert stats["captures"] == 1 and stats["replays"] == 17, stats
    # the same kernels, replayed: equal to the same step run eagerly
    ref_curve, ref_weights, _ = runs["step-eager"]
    assert curve == pytest.approx(ref_curve, rel=1e-5), (curve, ref_curve)
    for a, b in zip(weights, ref_weights):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # and to megatron's own optimizer step (TE FusedAdam, host-side clipping) within bf16
    eager_curve, eager_weights, _ = runs["eager"]
    assert [c[0] for c in curve] == pytest.approx([c[0] for c in eager_curve], rel=2e-3)
    assert [c[1] for c in curve] == pytest.approx([c[1] for c in eager_curve], rel=2e-2)
    for a, b in zip(weights, eager_weights):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_fp8_step_graphs_equal_fp8_eager(tmp_path):
    """FP8 with current scaling: every scale is computed on the device from its tensor, so
    the whole step (quantization included) is one graph and replays what eager FP8 does."""
    fp8 = ["train.precision=fp8", "train.fp8_recipe=current"]
    runs = {}
    for name, over in {"eager": [*STEP, "graphs.warmup_steps=1000"],
                       "graphs": [*STEP, "graphs.warmup_steps=3"]}.items():
        t = make_trainer(tmp_path / name, *TWO_MICROBATCHES, *fp8, *over)
        try:
            runs[name] = run_steps(t, 0, 12), t.graphs.stats()
        finally:
            t.close(shutdown_dist=False)
    (curve, stats), (ref, _) = runs["graphs"], runs["eager"]
    assert stats["captures"] == 1 and stats["replays"] == 9, stats
    assert curve == pytest.approx(ref, rel=1e-5), (curve, ref)


def whole_and_resumed(tmp_path, first_over, resume_over):
    """Steps 1-12 of a run under ``first_over``, saved after step 6, and steps 7-12 of a run
    resumed from that checkpoint under ``resume_over``: (whole, resumed, the resumed run's
    graph stats), each step's (loss, grad norm)."""
    t = make_trainer(tmp_path, *first_over)
    try:
        first = run_steps(t, 0, 6)
        t.checkpointer.save(t.step)
        whole = first + run_steps(t, 6, 12)
    finally:
        t.close(shutdown_dist=False)
    t = make_trainer(tmp_path, *resume_over)
    try:
        t.maybe_resume()
        assert t.step == 6
        resumed = run_steps(t, 6, 12)
        return whole, resumed, t.graphs.stats()
    finally:
        t.close(shutdown_dist=False)


def test_step_graphs_capture_again_after_a_checkpoint_load(tmp_path):
    over = [*TWO_MICROBATCHES, *STEP, "graphs.warmup_steps=2"]
    whole, resumed, stats = whole_and_resumed(tmp_path, over, over)
    assert stats["captures"] == 1  # warmed up again, then captured
    assert resumed == pytest.approx(whole[6:], rel=1e-5)


def two_gpu_run(run, *extra):
    """torchrun, dp=2: 20 steps of a 2-layer ViT-B/16 on the embedded data under ``extra``;
    the log's training records."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "vitgraph", "train",
           str(ROOT / "configs" / "vit-b16-imagefolder.yaml"), "data.kind=shapes",
           "data.num_train=640", "data.num_val=64", "data.render_size=32",
           "model.num_layers=2", "train.steps=20", "train.global_batch_size=32",
           "train.micro_batch_size=8", "train.log_every=1", "train.eval_every=0",
           "train.tensorboard=false", "train.progress=false", "data.workers=2",
           f"run.dir={run}", *extra]
    r = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()
            if '"loss"' in x]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("fused_norm", ["never", "always"])
def test_step_graphs_equal_eager_with_two_data_parallel_ranks(tmp_path, fused_norm):
    """torchrun, dp=2 with the distributed optimizer: the graph holds the gradient
    reduce-scatter, the sharded AdamW step and the parameter all-gather."""
    def train(name, *extra):
        return two_gpu_run(tmp_path / name, f"model.fused_norm={fused_norm}", *STEP, *extra)

    graphs = train("graphs", "graphs.warmup_steps=3")
    eager = train("eager", "graphs.warmup_steps=1000")
    assert graphs[-1]["graphs_replays"] == 17 and "graphs_replays" in eager[-1]
    assert [r["loss"] for r in graphs] == pytest.approx([r["loss"] for r in eager], rel=1e-5)
    assert [r["grad_norm"] for r in graphs] == pytest.approx([r["grad_norm"] for r in eager],
                                                             rel=1e-5)
