"""Config loading, overrides and every validation error: exit code 2, message names the key."""
import subprocess

import pytest
import yaml

from vitgraph.cli import main
from vitgraph.config import Config, ConfigError, load_config
from vitgraph.train.runcheck import save_config

from conftest import ROOT, vitgraph_cmd

DEFAULT = ROOT / "configs" / "vit-tiny-shapes.yaml"


def test_default_config_loads_and_overrides_apply():
    cfg = load_config(DEFAULT, ["train.steps=7", "optim.lr=1e-2", "model.num_registers=2"])
    assert isinstance(cfg, Config)
    assert cfg.train.steps == 7 and cfg.optim.lr == 0.01 and cfg.model.num_registers == 2
    assert cfg.data.kind == "shapes"


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")))
def test_every_shipped_config_has_a_launch_header(path):
    head = path.read_text().splitlines()[:20]
    assert head[0].startswith("# ")
    assert any("vitgraph train" in line or "train.sh" in line for line in head), path


@pytest.mark.parametrize("overrides,key", [
    (["train.stpes=5"], "train.stpes"),                   # unknown key
    (["train.steps=five"], "train.steps"),                # wrong type
    (["train.steps=1.5"], "train.steps"),                 # float for int
    (["model.image_size=30"], "model.image_size"),        # not divisible by patch 4
    (["data.kind=imagefolder"], "data.path"),             # missing data path
    (["data.kind=imagefolder", "data.path=/nonexistent/x"], "data.path"),
    (["model.spec=jax"], "model.spec"),                   # bad choice
    (["model.name=vit_gigantic"], "model.name"),
    (["train.global_batch_size=30", "train.micro_batch_size=8"], "train.global_batch_size"),
    (["parallel.pp=3"], "parallel.pp"),                   # world size 1 not divisible by 3
    (["parallel.tp=3", "model.num_heads=4"], "parallel.tp"),
    (["graphs.impl=cuda"], "graphs.impl"),
])
def test_config_errors_exit_2_and_name_the_key(overrides, key, capsys):
    assert main(["train", str(DEFAULT), *overrides]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and key in err, err
    assert str(DEFAULT) in err or "override" in err


@pytest.mark.parametrize("overrides,key,why", [
    # 4 layers over pp 2 x vpp 4 virtual stages
    (["parallel.pp=2", "parallel.vpp=4"], "parallel.pp", "parallel.pp x parallel.vpp = 2 x 4"),
    (["parallel.vpp=2"], "parallel.vpp", "need parallel.pp > 1"),
    (["parallel.tp=2", "model.num_heads=3", "model.hidden_size=66"], "parallel.tp",
     "num_heads=3 is not divisible"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel", "needs parallel.tp > 1"),
    # 32 / 16 = 2 microbatches, interleaving over 4 stages needs a multiple of 4
    (["parallel.pp=4", "parallel.vpp=1", "model.num_layers=8", "parallel.vpp=2",
      "train.micro_batch_size=16"], "train.global_batch_size", "multiple of parallel.pp=4"),
    (["train.precision=fp8", "model.spec=torch"], "train.precision", "Transformer Engine"),
    (["train.precision=fp8", "graphs.enabled=true"], "graphs.impl", "graphs.impl=te"),
    (["train.fp8_recipe=hybrid"], "train.fp8_recipe", "current, delayed, mxfp8"),
    (["train.precision=fp8", "train.fp8_recipe=delayed", "graphs.enabled=true", "graphs.scope=step"],
     "graphs.scope", "only with train.fp8_recipe=current"),
    (["parallel.timeout_minutes=0"], "parallel.timeout_minutes", "positive"),
    (["parallel.pp=2", "graphs.enabled=true", "graphs.pool=shared"], "graphs.pool", "needs parallel.pp=1"),
])
def test_impossible_layouts_and_precisions_exit_2(monkeypatch, capsys, overrides, key, why):
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert main(["train", str(DEFAULT), "train.global_batch_size=32",
                 "train.micro_batch_size=4", *overrides]) == 2
    err = capsys.readouterr().err
    assert key in err and why in err, err


def test_unknown_key_suggests_the_closest(capsys):
    assert main(["train", str(DEFAULT), "optim.learning_rate=1"]) == 2
    assert main(["train", str(DEFAULT), "trian.steps=1"]) == 2
    err = capsys.readouterr().err
    assert "'optim.learning_rate'" in err
    assert "did you mean 'train'" in err


def test_world_size_not_divisible_by_tp_pp(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["train", str(DEFAULT), "parallel.tp=2"]) == 2
    err = capsys.readouterr().err
    assert "parallel.tp" in err and "world size 3" in err
    assert main(["train", str(DEFAULT), "parallel.pp=3"]) == 2  # 4 layers over 3 stages
    assert "model.num_layers=4 is not divisible" in capsys.readouterr().err


def test_bad_yaml_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    assert main(["train", str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err
    missing = tmp_path / "missing.yaml"
    assert main(["train", str(missing)]) == 2
    assert "not found" in capsys.readouterr().err


def test_both_durations_in_a_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"train": {"steps": 3, "epochs": 1}}))
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(f)


def test_unknown_key_in_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"train": {"steps": 3, "warmup": 1}}))
    with pytest.raises(ConfigError, match=r"c\.yaml: unknown key 'train\.warmup'"):
        load_config(f)


def test_cli_process_exit_code_is_2(env):
    r = subprocess.run(vitgraph_cmd("train", str(DEFAULT), "train.stpes=5"), env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "train.stpes" in r.stderr and "Traceback" not in r.stderr


def test_duration_override_replaces_the_files_other_duration():
    cfg = load_config(ROOT / "configs" / "vit-b16-imagefolder.yaml",
                      ["data.kind=shapes", "train.steps=200"])
    assert cfg.train.steps == 200 and cfg.train.epochs is None
    cfg = load_config(DEFAULT, ["train.epochs=1.5"])
    assert cfg.train.epochs == 1.5 and cfg.train.steps is None


def test_unreadable_imagefolder_exits_2_naming_the_file(tmp_path, capsys):
    for split in ("train", "val"):
        (tmp_path / split / "cat").mkdir(parents=True)
        (tmp_path / split / "cat" / "broken.png").write_bytes(b"not a png")
    code = main(["train", str(DEFAULT), "data.kind=imagefolder", f"data.path={tmp_path}",
                 "model.spec=torch", "train.steps=1", f"run.dir={tmp_path / 'run'}",
                 "train.tensorboard=false"])
    assert code == 2
    err = capsys.readouterr().err
    assert "data error" in err and "broken.png" in err


# ---------------------------------------------------------------- keys declared on their fields

@pytest.mark.parametrize("overrides,message", [
    (["model.spec=toch"],
     "model.spec='toch': must be one of auto, te, torch (did you mean 'torch'?)"),
    (["graphs.pool=shard"],
     "graphs.pool='shard': must be one of auto, shared, slot (did you mean 'shared'?)"),
    (["graphs.enabled=maybe"], "graphs.enabled='maybe': must be one of true, false, auto"),
    (["graphs.enabled=1"], "graphs.enabled=1: must be one of true, false, auto"),
    (["optim.lr=0"], "optim.lr=0.0: must be positive"),
    (["optim.warmup_fraction=1"], "optim.warmup_fraction=1.0: must be in [0, 1)"),
    (["data.cpu_decode_share=1.5"], "data.cpu_decode_share=1.5: must be in [0, 1]"),
    (["parallel.vpp=0"], "parallel.vpp=0: must be >= 1"),
    (["checkpoint.every=-1"], "checkpoint.every=-1: must be >= 0"),
    (["data.augment.magnitude=11"], "data.augment.magnitude=11.0: must be in [0, 10]"),
    (["data.augment.crop_scale_min=0"], "data.augment.crop_scale_min=0.0: must be in (0, 1]"),
    (["data.augment.crop_scale_min=0.5", "data.augment.crop_scale_max=0.4"],
     "data.augment.crop_scale_max=0.4: must be >= data.augment.crop_scale_min"),
    (["task.templates=[a photo]"], 'task.templates=[\'a photo\']: a non-empty list of prompts'),
])
def test_field_declared_choices_and_ranges(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, overrides)
    assert str(e.value).startswith(f"override {message}"), e.value  # given on the command line


def test_defaults_pass_their_own_declarations():
    from vitgraph.config_keys import check_section
    check_section(Config(), "")  # every default among its choices and inside its range


def test_sections_check_themselves_with_the_same_error():
    """graphs and augment are used on their own (GraphManager, BatchAugment): the same check,
    the same ConfigError (a ValueError), without a file name."""
    from vitgraph.data.augment import AugmentConfig
    from vitgraph.graphs.config import GraphsConfig
    with pytest.raises(ConfigError, match=r"^graphs\.impl='cuda': must be one of local, te$"):
        GraphsConfig(impl="cuda")
    with pytest.raises(ConfigError, match=r"^graphs\.capture_warmup_iters must be an int"):
        GraphsConfig(capture_warmup_iters=1.5)
    assert GraphsConfig(enabled="auto").enabled == "auto"
    with pytest.raises(ConfigError, match=r"^data\.augment\.flip=2: must be in \[0, 1\]$"):
        AugmentConfig(flip=2).validate()


def test_graphs_enabled_auto_is_kept_for_start_up():
    # resolved at start-up, where the machine is known (vitgraph.graphs.auto), not when loaded
    assert load_config(DEFAULT).graphs.enabled == "auto"
    assert load_config(DEFAULT, ["graphs.enabled=true"]).graphs.enabled is True
    # the graphs rules bind an explicit true, not auto
    load_config(DEFAULT, ["train.precision=fp8", "model.spec=te", "graphs.enabled=auto"])


def test_keys_say_whether_a_resume_may_change_them():
    from vitgraph.config import may_change_on_resume
    for key in ("train.steps", "train.micro_batch_size", "data.workers", "data.decode", "parallel.tp",
                "parallel.vpp", "graphs.scope", "graphs.enabled", "checkpoint.keep", "run.name"):
        assert may_change_on_resume(key), key
    for key in ("model.name", "train.global_batch_size", "optim.lr", "data.augment.enabled",
                "parallel.distributed_optimizer", "train.nosuch", "nosuch.key", "train"):
        assert not may_change_on_resume(key), key


# ---------------------------------------------------------------- overrides

def test_unknown_key_on_the_command_line_is_an_error_of_the_override():
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, ["train.stepz=5"])
    assert str(e.value) == ("override 'train.stepz=5': unknown key 'train.stepz' "
                            "(did you mean 'train.steps'?)")
    with pytest.raises(ConfigError,
                       match=r"^override 'train.steps=five': train.steps must be an int"):
        load_config(DEFAULT, ["train.steps=five"])


# ---------------------------------------------------------------- the world size

def test_validate_reads_no_environment(monkeypatch):
    """Whether a config is valid does not depend on how it was launched; the layout is checked
    once the world size is known."""
    from vitgraph.config import check_layout
    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = load_config(DEFAULT, ["parallel.tp=2"])  # tp 2 in a world of 3: not validate's
    check_layout(cfg, 2)
    with pytest.raises(ConfigError, match=r"parallel.tp x parallel.pp = 2 x 1: world size 3"):
        check_layout(cfg, 3)
    with pytest.raises(ConfigError, match=r"train.global_batch_size=32: not divisible by "
                                          r"train.micro_batch_size x data-parallel size = 32 x 2"):
        check_layout(cfg, 4)
    # 4 layers over pp 2 x vpp 2; microbatches per step = 32 / (8 x dp)
    cfg = load_config(DEFAULT, ["parallel.pp=2", "parallel.vpp=2", "train.micro_batch_size=8"])
    check_layout(cfg, 2)
    check_layout(cfg, 4)
    with pytest.raises(ConfigError,
                       match=r"microbatches per step \(1 = .* multiple of parallel.pp=2"):
        check_layout(cfg, 8)
    # the shipped tp-2 config loads anywhere
    load_config(ROOT / "configs" / "vit-l16-imagefolder.yaml", ["data.kind=shapes"])


def test_the_plan_checks_the_layout_before_any_process_group():
    import torch.distributed as dist

    from vitgraph.plan import resolve
    if dist.is_initialized():
        pytest.skip("a process group of another test is up")
    with pytest.raises(ConfigError, match="world size 3"):
        resolve(load_config(DEFAULT, ["parallel.tp=2", "model.spec=torch"]), 3)
    assert not dist.is_initialized()


# ---------------------------------------------------------------- base: inheritance

def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_config_inherits_its_base_key_by_key(tmp_path):
    _write(tmp_path / "root.yaml", "model: {name: vit_pico_patch4_32, num_registers: 1}\n"
           "train: {epochs: 2, seed: 7, global_batch_size: 16, micro_batch_size: 16}\n"
           "task: {templates: ['a {}', 'the {}']}\n"
           "data: {augment: {enabled: true, flip: 0.1, mixup_alpha: 0.5}}\n")
    _write(tmp_path / "a" / "mid.yaml", "base: ../root.yaml\ndata: {augment: {flip: 0.2}}\n"
           "task: {templates: ['one {}']}\n")
    child = _write(tmp_path / "b" / "child.yaml", "base: ../a/mid.yaml\ntrain: {steps: 5}\n"
                   "graphs:\nrun: {name: child}\n")
    cfg = load_config(child)
    a = cfg.data.augment
    assert a.enabled and a.flip == 0.2 and a.mixup_alpha == 0.5  # nested mappings merged
    assert cfg.task.templates == ["one {}"]  # lists replaced
    assert cfg.model.num_registers == 1 and cfg.train.seed == 7  # from two files up
    assert cfg.train.steps == 5 and cfg.train.epochs is None  # a duration replaces the other
    assert cfg.run.name == "child"
    saved = tmp_path / "run" / "config.yaml"
    save_config(cfg, saved)  # the resolved config, no base
    raw = yaml.safe_load(saved.read_text())
    assert "base" not in raw and raw["data"]["augment"]["mixup_alpha"] == 0.5
    assert load_config(saved).to_dict() == cfg.to_dict()


def test_a_base_cycle_or_a_missing_base_is_an_error_naming_the_files(tmp_path, capsys):
    a = _write(tmp_path / "a.yaml", "base: b.yaml\n")
    b = _write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError) as e:
        load_config(a)
    assert str(e.value) == f"{a}: the base files make a cycle: {a} -> {b} -> {a}"
    own = _write(tmp_path / "own.yaml", "base: own.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(own)
    orphan = _write(tmp_path / "orphan.yaml", "base: gone.yaml\n")
    with pytest.raises(ConfigError) as e:
        load_config(orphan)
    assert str(orphan) in str(e.value) and str(tmp_path / "gone.yaml") in str(e.value)
    assert main(["train", str(orphan)]) == 2
    assert "not found" in capsys.readouterr().err
    bad = _write(tmp_path / "bad.yaml", "base: [x]\n")
    with pytest.raises(ConfigError, match="bad.yaml: base="):
        load_config(bad)


def test_an_error_in_a_base_names_that_file(tmp_path):
    base = _write(tmp_path / "base.yaml", "train: {stpes: 3}\n")
    child = _write(tmp_path / "child.yaml", "base: base.yaml\n")
    with pytest.raises(ConfigError, match=rf"^{base}: unknown key 'train.stpes'"):
        load_config(child)
    _write(tmp_path / "base.yaml", "model: {spec: jax}\n")
    with pytest.raises(ConfigError, match=rf"^{child} \(base {base}\): model.spec='jax'"):
        load_config(child)


def test_the_l16_config_is_the_b16_config_with_its_own_differences():
    b16 = load_config(ROOT / "configs" / "vit-b16-imagefolder.yaml", ["data.kind=shapes"])
    l16 = load_config(ROOT / "configs" / "vit-l16-imagefolder.yaml", ["data.kind=shapes"])
    flat = [{f"{s}.{k}": v for s, sec in c.to_dict().items() for k, v in sec.items()}
            for c in (b16, l16)]
    differ = {k for k in flat[0] if flat[0][k] != flat[1][k]}
    assert differ == {"model.name", "train.micro_batch_size", "optim.lr", "optim.warmup_steps",
                      "parallel.tp", "run.name"}
    assert (l16.model.name, l16.parallel.tp, l16.train.micro_batch_size, l16.graphs.enabled) == \
        ("vit_l16_224", 2, 64, "auto")
    assert l16.train.global_batch_size == 4096 and l16.train.epochs == 300
    assert l16.data.augment.enabled and l16.model.spec == "te"


@pytest.mark.parametrize("over,match", [
    (["parallel.distributed_optimizer=false"], "optim.offload_fraction=0.5.*distributed_optimizer"),
    (["graphs.enabled=true", "graphs.scope=step"], "optim.offload_fraction=0.5.*graphs.scope=step"),
    (["train.ema.decay=0.999"], "optim.offload_fraction=0.5.*train.ema"),
])
def test_optimizer_offload_names_what_it_cannot_serve(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["optim.offload_fraction=0.5", *over])


def test_graphs_auto_takes_layer_graphs_with_an_offloaded_optimizer():
    from vitgraph.config import graph_constraints
    from vitgraph.graphs.auto import choose_graphs
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml",
                      ["optim.offload_fraction=0.5"])
    path = choose_graphs(cfg.graphs, True, **graph_constraints(cfg))
    assert path.config.enabled and path.config.scope == "layer" and "offload" in path.reason
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml")
    assert choose_graphs(cfg.graphs, True, **graph_constraints(cfg)).config.scope == "step"


def test_a_folder_config_loads_without_its_folder_for_what_reads_no_data():
    path = ROOT / "configs" / "vit-b16-imagefolder.yaml"
    with pytest.raises(ConfigError, match="data.path"):
        load_config(path)
    assert load_config(path, data=False).data.path is None


def test_big_tower_configs_carry_a_smoke_command_that_asks_the_loss_to_fall():
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    from smoke_configs import smoke_spec
    for name in ("vit-g14", "vit-bigG14", "vit-6b"):
        over, ask = smoke_spec(ROOT / "configs" / f"{name}-imagefolder.yaml")
        assert ask == 0 and "checkpoint.save=false" in over
    assert smoke_spec(ROOT / "configs" / "vit-b16-imagefolder.yaml")[1] == pytest.approx(0.20)


FSDP = ["parallel.fsdp=true", "parallel.distributed_optimizer=false"]


@pytest.mark.parametrize("over,match", [
    (["parallel.fsdp=true"], "parallel.fsdp=True.*distributed_optimizer=false"),
    ([*FSDP, "graphs.enabled=true"], "parallel.fsdp=True.*CUDA graphs"),
    ([*FSDP, "parallel.pp=2"], "parallel.fsdp=True.*parallel.pp=1"),
    # megatron offloads the distributed optimizer's state, which FSDP replaces
    ([*FSDP, "optim.offload_fraction=0.5"], "optim.offload_fraction=0.5.*distributed_optimizer"),
    ([*FSDP, "train.ema.decay=0.999"], "train.ema.decay=0.999.*parallel.fsdp"),
    ([*FSDP, 'model.freeze=["decoder.layers.0.*"]'], "model.freeze=.*parallel.fsdp"),
])
def test_fsdp_names_what_it_cannot_serve(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", over)


def test_graphs_auto_runs_fsdp_eagerly():
    from vitgraph.config import graph_constraints
    from vitgraph.graphs.auto import choose_graphs
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", FSDP)
    path = choose_graphs(cfg.graphs, True, **graph_constraints(cfg))
    assert not path.config.enabled and "parallel.fsdp" in path.reason


def test_a_mistake_in_an_override_names_the_command_line_not_the_file(tmp_path):
    """`vitgraph train vit-b16-imagefolder.yaml data.path=/missing` blamed the YAML file."""
    b16 = ROOT / "configs" / "vit-b16-imagefolder.yaml"
    missing = tmp_path / "missing"
    for path, overrides, want in [
            (b16, [f"data.path={missing}"], f"override data.path={str(missing)!r}: no such directory"),
            (DEFAULT, ["train.steps=-3"], "override train.steps=-3: must be positive")]:
        with pytest.raises(ConfigError) as e:
            load_config(path, overrides)
        assert str(e.value) == want
    own = tmp_path / "own.yaml"  # the file's own value: the file is named
    own.write_text(f"base: {DEFAULT}\ndata: {{kind: imagefolder, path: {missing}}}\n")
    with pytest.raises(ConfigError) as e:
        load_config(own, ["train.steps=5"])
    assert str(e.value).startswith(f"{own} (base {DEFAULT}): data.path="), str(e.value)


def test_the_so400m_vlm_config_and_its_smoke_line_resolve():
    """configs/vlm-so400m16-native.yaml (a GPU config, not run here) resolves for 8 GPUs
    (shapes for its shards) and for one with its header's smoke-line overrides: the SO400M/16
    tower at native resolution, the 0.5B GPT, layer graphs."""
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    from smoke_configs import smoke_spec
    from vitgraph.plan import resolve
    path = ROOT / "configs" / "vlm-so400m16-native.yaml"
    args, ask = smoke_spec(path)  # scripts/gpu_check.sh configs runs it, asking the loss to fall
    overrides = args[1:]
    assert ask == 0 and "train.steps=20" in overrides and "data.kind=shapes" in overrides
    resolve(load_config(path, ["data.kind=shapes", "model.spec=torch"]), 8)
    plan = resolve(load_config(path, [*overrides, "model.spec=torch"]), 1)
    assert plan.task == "caption" and plan.native and plan.graphs.scope == "layer"
    assert (plan.arch.hidden_size, plan.arch.num_layers, plan.arch.patch_size) == (1152, 27, 16)
    assert (plan.pack.tokens, plan.pack.max_patches) == (16384, 1024)
    c = plan.caption
    assert (c.num_layers, c.hidden_size, c.num_heads, c.vocab_size) == (24, 1280, 20, 49408)
