"""GPU: distillation (train.distill) on the Trainer's real path: a vitgraph teacher (TE spec,
bf16) under its forward CUDA graph gives the eager teacher's logits, and a TE-spec student
distilling under step graphs runs with finite losses equal to the same steps run eagerly."""
import math

import pytest
import torch

from test_step_graphs_gpu import STEP, TWO_MICROBATCHES, run_steps
from test_train_gpu import make_trainer

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    """A 2-step run of the 2-layer B/16 (its checkpoint is the teacher)."""
    run_dir = tmp_path_factory.mktemp("teacher")
    t = make_trainer(run_dir, "train.steps=2", "model.num_classes=10")
    try:
        t.run()
    finally:
        t.close(shutdown_dist=False)
    return run_dir


def test_teacher_forward_graph_equals_eager(tmp_path, teacher_run):
    t = make_trainer(tmp_path, "model.num_classes=10", f"train.distill.teacher={teacher_run}")
    try:
        teacher = t.task.teacher
        assert teacher.graphs is not None and teacher.dtype == torch.bfloat16
        assert teacher.graphs.backend.name == "cuda"
        assert not any(p.requires_grad for p in teacher.module.parameters())
        g = torch.Generator(device="cuda").manual_seed(0)
        xs = [torch.randn(8, 3, 224, 224, device="cuda", generator=g) for _ in range(3)]
        with torch.no_grad():
            eager = [teacher._forward(x) for x in xs]
        graphed = [teacher(x) for x in xs]  # the first captures, the others replay
        assert len(teacher.graphs.graphs) == 1
        for e, gr in zip(eager, graphed):
            assert gr.dtype == torch.float32 and gr.shape == (8, 10)
            assert torch.isfinite(gr).all()
            assert torch.allclose(gr, e, atol=1e-2, rtol=1e-2), (gr - e).abs().max()
        assert not torch.equal(graphed[0], graphed[1])  # a copy per call, not the static output
        # another batch size: a graph of its own
        small = teacher(xs[0][:4])
        assert len(teacher.graphs.graphs) == 2
        assert torch.allclose(small, eager[0][:4], atol=1e-2, rtol=1e-2)
    finally:
        t.close(shutdown_dist=False)


@pytest.mark.parametrize("kind", ["soft", "hard"])
def test_distillation_under_step_graphs(tmp_path, teacher_run, kind):
    runs = {}
    distill = [f"train.distill.teacher={teacher_run}", f"train.distill.kind={kind}",
               "train.distill.temperature=2", "model.num_classes=10",
               "data.augment.enabled=true"]
    for name, over in {"step-eager": [*STEP, "graphs.warmup_steps=1000"],
                       "step-graphs": [*STEP, "graphs.warmup_steps=2"]}.items():
        t = make_trainer(tmp_path / name, *TWO_MICROBATCHES, *distill, *over)
        try:
            runs[name] = (run_steps(t, 0, 6), t.graphs.stats())
        finally:
            t.close(shutdown_dist=False)
    curve, stats = runs["step-graphs"]
    assert stats["captures"] == 1, stats
    assert all(math.isfinite(loss) and math.isfinite(g) for loss, g in curve), curve
    assert curve == pytest.approx(runs["step-eager"][0], rel=1e-4)
