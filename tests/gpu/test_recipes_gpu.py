"""GPU: the training recipes inside CUDA graphs (TE spec, one GPU): what the graphs replay
equals the same steps run eagerly."""
import pytest

from test_step_graphs_gpu import TWO_MICROBATCHES, params, run_steps
from test_train_gpu import make_trainer

pytestmark = pytest.mark.gpu


# fused_norm=always: the survivors' scale inside the Triton add + norm kernels, and under layer
# graphs the MLP branch's factor handed to the next layer's graph in its context
@pytest.mark.parametrize("scope, fused_norm", [("step", "never"), ("step", "always"),
                                               ("layer", "never"), ("layer", "always")])
def test_drop_path_in_graphs_equals_eager(tmp_path, scope, fused_norm):
    """model.drop_path_rate=0.1 over 4 layers: the masks are drawn on the device inside the
    captured step or layer (torch's default CUDA generator, registered with the graph) and
    each replay draws the step's new ones, so the graphed curve is the eager one for the same
    seed (eager: the same run with graphs still warming up); a run without drop path gives
    another curve (the masks matter)."""
    import torch
    runs = {}
    drop = ["model.drop_path_rate=0.1"]
    graphs = ["graphs.enabled=true", f"graphs.scope={scope}"]
    for name, over in {"eager": [*drop, *graphs, "graphs.warmup_steps=1000"],
                       "graphs": [*drop, *graphs, "graphs.warmup_steps=3"],
                       "no-drop": [*graphs, "graphs.warmup_steps=1000"]}.items():
        t = make_trainer(tmp_path / name, *TWO_MICROBATCHES, *over, "model.num_layers=4",
                         "model.spec=te", f"model.fused_norm={fused_norm}")
        try:
            layers = [m for c in t.chunks for m in c.modules() if hasattr(m, "drop_path")]
            runs[name] = (run_steps(t, 0, 10), params(t), t.graphs.stats(),
                          [m.drop_path for m in layers])
        finally:
            t.close(shutdown_dist=False)
    curve, weights, stats, rates = runs["graphs"]
    assert rates == pytest.approx([0.0, 0.1 / 3, 0.2 / 3, 0.1]), rates
    if scope == "step":
        assert stats["captures"] == 1 and stats["replays"] == 7, stats
    else:
        assert stats["captures"] > 0 and stats["replays"] > 0, stats
    ref_curve, ref_weights, _, _ = runs["eager"]
    # the step graph replays the eager step's kernels; layer graphs leave what runs between
    # layers eager, where bf16 rounding may differ a little (vitgraph.graphs tests)
    tol = 1e-5 if scope == "step" else 1e-4
    assert curve == pytest.approx(ref_curve, rel=tol), (curve, ref_curve)
    for a, b in zip(weights, ref_weights):
        torch.testing.assert_close(a, b, rtol=10 * tol, atol=1e-6 if scope == "step" else 1e-5)
    other = [c[0] for c in runs["no-drop"][0]]
    assert [c[0] for c in ref_curve] != pytest.approx(other, rel=1e-4), (ref_curve, other)


def test_drop_path_and_ema_in_step_graphs_equal_eager(tmp_path):
    """Drop path and an EMA of the weights inside the step graph: after 20 steps the loss
    curve and the EMA weights equal the same run stepped eagerly (graphs still warming up);
    the EMA is not the raw weights (it averages)."""
    import torch
    runs = {}
    over = ["model.drop_path_rate=0.1", "train.ema.decay=0.9", "graphs.enabled=true",
            "graphs.scope=step", "model.num_layers=4", "model.spec=te"]
    for name, warm in (("eager", 1000), ("graphs", 3)):
        t = make_trainer(tmp_path / name, *TWO_MICROBATCHES, *over, f"graphs.warmup_steps={warm}")
        try:
            curve = run_steps(t, 0, 20)
            runs[name] = (curve, t.ema.named(t.chunks), params(t), float(t.ema.count),
                          t.graphs.stats())
        finally:
            t.close(shutdown_dist=False)
    curve, ema, weights, count, stats = runs["graphs"]
    ref_curve, ref_ema, _, ref_count, _ = runs["eager"]
    assert stats["captures"] == 1 and stats["replays"] == 17, stats
    assert count == ref_count == 20
    assert curve == pytest.approx(ref_curve, rel=1e-5), (curve, ref_curve)
    assert ema.keys() == ref_ema.keys()
    for k in ema:
        torch.testing.assert_close(ema[k], ref_ema[k], rtol=1e-4, atol=1e-6)
    assert not all(any(e.shape == w.shape and torch.equal(e, w) for w in weights)
                   for e in ema.values())
