"""Frozen parameters (model.freeze, task.lock_image): unchanged by training, no gradient and no
optimizer state, still in the checkpoint's model state, and a run with them resumes; patterns
that match nothing or freeze everything are config errors; `vitgraph params` lists what the
patterns match."""
import pytest
import torch

from conftest import ROOT, checkpoint_tensors, tiny_overrides
from vitgraph.cli import main

DEFAULT = str(ROOT / "configs" / "vit-tiny-shapes.yaml")
CLIP = str(ROOT / "configs" / "clip-tiny-shapes.yaml")
FROZEN = ["patch_embed.*", "pos_embed", "decoder.layers.0.*"]


def freeze_override(patterns) -> str:
    return "model.freeze=[" + ", ".join(f'"{p}"' for p in patterns) + "]"


def make_trainer(config, run_dir, steps, *extra):
    from vitgraph.config import load_config
    from vitgraph.train.loop import Trainer
    return Trainer(load_config(config, tiny_overrides(run_dir, steps=steps) + list(extra)))


def snapshot(chunk) -> dict:
    return {n: p.detach().clone() for n, p in chunk.named_parameters()}


def is_frozen(name: str) -> bool:
    return name.startswith(("patch_embed.", "decoder.layers.0.")) or name == "pos_embed"


def test_frozen_parameters_stay_put_without_optimizer_state_and_resume(tmp_path):
    run = tmp_path / "run"
    t = make_trainer(DEFAULT, run, 20, freeze_override(FROZEN))
    try:
        chunk = t.chunks[0]
        before = snapshot(chunk)
        frozen = {n for n in before if is_frozen(n)}
        assert len(frozen) == 3 + 12  # patch weight and bias, pos_embed, layer 0's twelve
        assert frozen == {n for n, p in chunk.named_parameters() if not p.requires_grad}
        in_groups = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
        assert all((id(p) in in_groups) == (n not in frozen) for n, p in chunk.named_parameters())
        t.run()
        after = snapshot(chunk)
        for n in before:
            if n in frozen:
                assert torch.equal(before[n], after[n]), n
                assert chunk.get_parameter(n).grad is None, n
        moved = [n for n in before if n not in frozen and not torch.equal(before[n], after[n])]
        assert "head.weight" in moved and "decoder.layers.1.mlp.linear_fc1.weight" in moved
        state = t.optimizer.state_dict()["state"]
        assert len(state) == sum(1 for n in before if n not in frozen)
    finally:
        t.close()
    saved = checkpoint_tensors(run / "checkpoints" / "step_000020")
    moments = [k for k in saved if k.startswith("optimizer.state.exp_avg.")]
    assert moments and not [k for k in moments if any(
        f".{n}" in k or k.endswith(n) for n in ("pos_embed", "patch_embed.weight"))]
    assert any(k.endswith("pos_embed") and not k.startswith("optimizer.") for k in saved)
    # layers stack into one tensor per name: the frozen layer 0's slice of its state is zeros
    fc1 = [v for k, v in saved.items() if k.startswith("optimizer.state.exp_avg.")
           and k.endswith("layers.mlp.linear_fc1.weight")]
    assert len(fc1) == 1 and fc1[0].shape[0] == 4
    assert not fc1[0][0].any() and fc1[0][1].abs().sum() > 0
    # the same run, longer: resumes from step 20 with the same groups; frozen weights stay put
    t = make_trainer(DEFAULT, run, 25, freeze_override(FROZEN))
    try:
        metrics = t.run()
        assert metrics["step"] == 25
        for n, p in t.chunks[0].named_parameters():
            if n in frozen:
                assert torch.equal(p.detach(), before[n]), n
    finally:
        t.close()


def test_lock_image_trains_the_text_tower_against_a_fixed_image_tower(tmp_path):
    t = make_trainer(CLIP, tmp_path / "run", 6, "task.lock_image=true", "data.num_train=256",
                     "data.num_val=100", "task.context_length=32", "model.num_layers=2")
    try:
        model = t.chunks[0]
        before = snapshot(model)
        assert not any(p.requires_grad for p in model.visual.parameters())
        assert all(p.requires_grad for p in model.text.parameters())
        t.run()
        after = snapshot(model)
        visual = [n for n in before if n.startswith("visual.")]
        assert visual and all(torch.equal(before[n], after[n]) for n in visual)
        for n in ("text.proj.weight", "text.decoder.layers.0.mlp.linear_fc1.weight",
                  "logit_scale"):
            assert not torch.equal(before[n], after[n]), n
    finally:
        t.close()


@pytest.mark.parametrize("extra, words", [
    (freeze_override(["decoder.layers.0.*", "nope.*"]), ["model.freeze", "'nope.*'"]),
    (freeze_override(["*"]), ["model.freeze", "every parameter"]),
    ("task.lock_image=true", ["task.lock_image", "contrastive"]),
])
def test_a_freeze_that_cannot_be_is_a_config_error(tmp_path, capsys, extra, words):
    code = main(["train", DEFAULT, *tiny_overrides(tmp_path / "run", steps=5), extra])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "config error" in err and all(w in err for w in words), err


def test_params_lists_names_scales_decay_and_frozen(capsys):
    code = main(["params", DEFAULT, "optim.layer_decay=0.5", freeze_override(["pos_embed"])])
    out = capsys.readouterr().out
    assert code == 0
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:-1]}
    assert rows["pos_embed"] == ["1x65x64", "0.03125", "off", "yes"]
    assert rows["decoder.layers.0.mlp.linear_fc1.weight"] == ["256x64", "0.0625", "on", "no"]
    assert rows["head.weight"] == ["10x64", "1", "on", "no"]
    assert len(rows) == 56 and "frozen: 1 tensor, " in out.splitlines()[-1]
    assert main(["params", DEFAULT, freeze_override(["nope"])]) == 2
    assert "model.freeze: pattern 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("impl", ["local", "te"])
def test_layer_graphs_of_frozen_layers_on_inputs_without_gradient(impl):
    """A frozen layer whose input needs no gradient (frozen embeddings before it) runs
    forward-only: no backward graph (local), eagerly (te: TE's capture would ask autograd for
    gradients of nothing); a frozen layer on a differentiable input still passes the input's
    gradient, and neither gives its weights a gradient."""
    import copy

    from test_graphs import Toy, _fake_te, assert_same_tree
    from vitgraph.graphs import GraphManager, GraphsConfig, RerunBackend
    torch.manual_seed(3)
    eager = Toy()
    for p in eager.parameters():
        p.requires_grad_(False)
    graphed = copy.deepcopy(eager)
    fake = _fake_te("new")
    mgr = GraphManager(GraphsConfig(enabled=True, impl=impl, warmup_steps=0), [graphed],
                       backend=RerunBackend(), te_make_graphed_callables=fake).apply()
    mgr.step_begin(0)
    x = torch.randn(4, 8)
    out = graphed(x, context=None, flag=False)
    assert_same_tree(out, eager(x, context=None, flag=False))
    assert not out[0].requires_grad
    if impl == "te":
        assert fake.calls == []  # not handed to TE
    xg = torch.randn(4, 8, requires_grad=True)
    xe = xg.detach().clone().requires_grad_()
    graphed(xg, context=None, flag=False)[0].sum().backward()
    eager(xe, context=None, flag=False)[0].sum().backward()
    torch.testing.assert_close(xg.grad, xe.grad)
    assert all(p.grad is None for p in graphed.parameters())
