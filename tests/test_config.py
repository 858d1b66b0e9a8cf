"""Config loading, overrides and every validation error: exit code 2, message names the key."""
import subprocess

import pytest
import yaml

from vitgraph.cli import main
from vitgraph.config import Config, ConfigError, load_config

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
