"""Activation recompute (train.recompute) on CPU, torch spec: the keys reach megatron's
TransformerConfig, full recompute trains the loss curve of no recompute (eager, layer and
step graphs on the rerun backend), and the combinations megatron's
checkpoint cannot serve are config errors naming the fix."""
import json

import pytest

from vitgraph.config import ConfigError, load_config

from conftest import ROOT, tiny_overrides, world_of_one

dist1 = world_of_one("torch")
CONFIG = ROOT / "configs" / "vit-tiny-shapes.yaml"


def _cfg(*over):
    return load_config(CONFIG, ["model.spec=torch", *over])


def _config_of(d, *over):
    from vitgraph.models.build import build_model
    from vitgraph.plan import resolve
    cfg = _cfg(*over)
    plan = resolve(cfg, d.world)
    return plan, build_model(plan, cfg.model, d, 10, cfg.train.seed)[0]


@pytest.mark.parametrize("over,want", [
    ([], (None, None, None, None)),
    (["train.recompute=full"], ("full", "uniform", 1, None)),
    (["train.recompute=full", "train.recompute_layers=3"], ("full", "uniform", 3, None)),
    (["train.recompute=full", "train.recompute_method=block"], ("full", "block", 4, None)),
    (["train.recompute=full", "train.recompute_method=block", "train.recompute_layers=40"],
     ("full", "block", 4, None)),
    (["train.recompute=selective"], ("selective", None, None, ["core_attn"])),
    (["train.recompute=selective", "train.recompute_modules=[mlp]"],
     ("selective", None, None, ["mlp"])),
])
def test_keys_reach_megatrons_transformer_config(dist1, over, want):
    plan, model = _config_of(dist1, *over)
    c = model.decoder.config
    got = (c.recompute_granularity, c.recompute_method, c.recompute_num_layers,
           c.recompute_modules if c.recompute_granularity == "selective" else None)
    assert got == want
    assert plan.recompute.name == (want[0] or "none")
    if want[3] and "mlp" in want[3]:
        assert all(layer.recompute_mlp for layer in model.decoder.layers)


def test_full_recompute_turns_auto_fused_norm_off(dist1):
    """megatron's block checkpoint hands tensors between its units, the fused layer a pair."""
    plan, _ = _config_of(dist1, "train.recompute=full", "model.fused_norm=auto",
                         "train.micro_batch_size=512", "train.global_batch_size=512")
    assert not plan.fused_norm
    plan, _ = _config_of(dist1, "model.fused_norm=auto", "train.micro_batch_size=512",
                         "train.global_batch_size=512")
    assert plan.fused_norm


@pytest.mark.parametrize("over,key", [
    (["train.recompute_layers=2"], "train.recompute_layers"),
    (["train.recompute=full", "train.recompute_modules=[mlp]"], "train.recompute_modules"),
    (["train.recompute=selective", "train.recompute_modules=[layernorm]"],
     "train.recompute_modules"),
    (["train.recompute=selective", "graphs.enabled=true", "graphs.scope=layer"],
     "train.recompute"),
    (["train.recompute=selective", "graphs.enabled=true", "graphs.scope=step"],
     "train.recompute"),
    (["train.recompute=full", "graphs.enabled=true", "model.drop_path_rate=0.1"],
     "train.recompute"),
    (["train.recompute=full", "model.fused_norm=always"], "model.fused_norm"),
])
def test_what_megatrons_checkpoint_cannot_serve_is_a_config_error(over, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _cfg(*over)


def test_auto_graphs_take_a_path_the_recompute_allows():
    from vitgraph.graphs import GraphsConfig, choose_graphs
    auto = GraphsConfig()
    assert choose_graphs(auto, True, recompute="full").scope == "step"
    assert choose_graphs(auto, True, recompute="selective").scope is None
    assert choose_graphs(auto, True, "fp8", "delayed", recompute="full").scope == "layer"
    assert choose_graphs(auto, True, recompute="full", random_layers=True).scope is None


def _run(tmp_path, name, *over):
    from vitgraph.train.loop import train
    run_dir = tmp_path / name
    cfg = load_config(CONFIG, tiny_overrides(run_dir, steps=6, **{
        "train.log_every": 1, "data.num_train": 128, "data.num_val": 32,
        "train.global_batch_size": 16, "train.micro_batch_size": 8,
        "model.num_layers": 4}) + list(over))
    train(cfg)
    recs = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}, recs


GRAPHS = ["graphs.enabled=true", "graphs.warmup_steps=2"]
RUNS = {
    "full-uniform": ["train.recompute=full"],
    "full-block-2": ["train.recompute=full", "train.recompute_method=block",
                     "train.recompute_layers=2"],
    "full-uniform-2-layer-graphs": ["train.recompute=full", "train.recompute_layers=2",
                                    *GRAPHS, "graphs.scope=layer"],
    "full-step-graphs": ["train.recompute=full", *GRAPHS, "graphs.scope=step"],
    # the MLP's checkpoint returns fc2's bias: a view of it, or the backward never ends
    "selective-attn-mlp": ["train.recompute=selective", "train.recompute_modules=[core_attn,mlp]"],
    "selective-mlp-fused-never": ["train.recompute=selective", "train.recompute_modules=[mlp]",
                                  "model.fused_norm=never"],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ref"), "none")[0]


@pytest.mark.parametrize("name", list(RUNS))
def test_recompute_trains_the_curve_of_no_recompute(tmp_path, reference, name):
    """fp32 on CPU: the recomputed forward is the same arithmetic, so the curve is equal."""
    got, recs = _run(tmp_path, name, *RUNS[name])
    if "graphs.enabled=true" in RUNS[name]:
        assert [r for r in recs if "loss" in r][-1]["graphs_replays"] > 0
    assert got.keys() == reference.keys()
    for s in reference:
        assert got[s] == pytest.approx(reference[s], rel=1e-5), (s, got, reference)

