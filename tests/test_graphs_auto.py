"""graphs.enabled: auto picks the graph path once at start-up, says why, and never overrides
an explicit choice."""
import pytest

from conftest import ROOT
from vitgraph.config import ConfigError, load_config
from vitgraph.graphs import GraphsConfig, choose_graphs


@pytest.mark.parametrize("cuda, precision, recipe, tp, want, why", [
    (False, "auto", "current", 1, "eager", "no CUDA device"),
    (False, "auto", "current", 2, "eager", "no CUDA device"),
    (True, "bf16", "current", 1, "step", "the whole step as one CUDA graph"),
    (True, "fp8", "current", 1, "step", "the whole step"),
    (True, "fp8", "delayed", 1, "layer", "amax history from the host"),
    (True, "bf16", "current", 2, "layer", "tensor parallelism (parallel.tp=2)"),
])
def test_auto_picks_the_fastest_valid_path_and_says_why(cuda, precision, recipe, tp, want, why):
    path = choose_graphs(GraphsConfig(), cuda, precision, recipe, tp)
    assert path.name == want and why in path.reason
    assert path.config.enabled is (want != "eager")
    if want == "layer":  # TE owns the FP8 state around a replay
        assert path.config.impl == ("te" if precision == "fp8" else "local")
    assert GraphsConfig().enabled == "auto"  # the default, and the input left as it was


@pytest.mark.parametrize("enabled, scope, cuda", [(True, "layer", True), (True, "step", False),
                                                  (False, "step", True)])
def test_an_explicit_setting_always_wins(enabled, scope, cuda):
    cfg = GraphsConfig(enabled=enabled, scope=scope, warmup_steps=7)
    path = choose_graphs(cfg, cuda, "fp8", "delayed")
    assert path.config == cfg and path.name == (scope if enabled else "eager")
    assert f"graphs.enabled={str(enabled).lower()}" in path.reason


def test_auto_keeps_the_sections_other_keys():
    path = choose_graphs(GraphsConfig(warmup_steps=5, max_slots=2), True)
    assert (path.config.warmup_steps, path.config.max_slots, path.config.scope) == (5, 2, "step")


def test_graphs_enabled_takes_true_false_or_auto():
    for value, want in (("auto", "auto"), ("true", True), ("false", False)):
        cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", [f"graphs.enabled={value}"])
        assert cfg.graphs.enabled == want
    with pytest.raises(ConfigError, match="graphs.enabled"):
        load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["graphs.enabled=maybe"])


def test_a_cpu_run_logs_the_eager_choice(tmp_path, capsys):
    from vitgraph.config import load_config as load
    from vitgraph.train.loop import train
    cfg = load(ROOT / "configs" / "vit-tiny-shapes.yaml",
               ["train.steps=2", "data.num_train=64", "data.num_val=32", "train.log_every=1",
                "train.eval_every=0", "train.tensorboard=false", "train.progress=false",
                f"run.dir={tmp_path}"])
    train(cfg)
    log = (tmp_path / "train.log").read_text()
    assert "graphs: eager (graphs.enabled=auto: no CUDA device" in log
