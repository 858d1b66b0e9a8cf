"""Bad input a new user gives: each stopped by the config (or, for what only the data can
tell, as soon as the data is read), one message naming where the value came from, the key and
the value; exit 2, nothing made."""
import tomllib
from pathlib import Path

import pytest

import vitgraph.config
from vitgraph.cli import main
from vitgraph.config import ConfigError, load_config, validate_machine
from vitgraph.data import class_count
from vitgraph.memory import model_of
from vitgraph.text import bpe
from vitgraph.train.metrics import train_line

from conftest import ROOT, write_photos

DEFAULT = ROOT / "configs" / "vit-tiny-shapes.yaml"
B16 = ROOT / "configs" / "vit-b16-imagefolder.yaml"


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _error(path, overrides=(), data=True) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides), data=data)
    return str(e.value)


# ------------------------------------------------------- values torch / megatron refuse later

@pytest.mark.parametrize("override,message", [
    ("model.num_classes=-3", "override model.num_classes=-3: must be positive"),
    ("model.num_classes=0", "override model.num_classes=0: must be positive"),
    ("optim.weight_decay=-0.1", "override optim.weight_decay=-0.1: must be >= 0"),
    ("optim.min_lr=1", "override optim.min_lr=1.0: must be <= optim.lr"),
    ("optim.beta1=1", "override optim.beta1=1.0: must be in [0, 1)"),
    ("optim.beta2=-0.5", "override optim.beta2=-0.5: must be in [0, 1)"),
    ("optim.eps=0", "override optim.eps=0.0: must be positive"),
    ("optim.clip_grad=-1", "override optim.clip_grad=-1.0: must be >= 0"),
    ("train.label_smoothing=1.5", "override train.label_smoothing=1.5: must be in [0, 1)"),
    ("train.label_smoothing=-0.1", "override train.label_smoothing=-0.1: must be in [0, 1)"),
    ("train.seed=-1", "override train.seed=-1: must be >= 0"),
    ("train.peak_flops=0", "override train.peak_flops=0.0: must be positive"),
    ("model.hidden_dropout=1", "override model.hidden_dropout=1.0: must be in [0, 1)"),
    ("model.attention_dropout=-0.1", "override model.attention_dropout=-0.1: must be in [0, 1)"),
    ("model.layernorm_epsilon=0", "override model.layernorm_epsilon=0.0: must be positive"),
    ("model.hidden_size=0", "override model.hidden_size=0: must be positive"),
    ("model.num_registers=-1", "override model.num_registers=-1: must be >= 0"),
    ("data.num_classes=0", "override data.num_classes=0: must be >= 1"),
    ("data.seed=-2", "override data.seed=-2: must be >= 0"),
])
def test_values_torch_or_megatron_would_refuse_later_are_config_errors(override, message):
    assert _error(DEFAULT, [override]) == message


def test_a_file_value_out_of_range_names_the_file(tmp_path):
    own = _write(tmp_path / "own.yaml", f"base: {DEFAULT}\noptim:\n  min_lr: 0.01\n")
    assert f"{own} (base {DEFAULT}): optim.min_lr=0.01: must be <= optim.lr" in _error(own)
    assert load_config(DEFAULT, ["optim.min_lr=1.5e-3"]).optim.min_lr == 1.5e-3  # = lr: fine


# ------------------------------------------------------- the head against the data's classes

def test_a_head_smaller_than_the_shapes_classes_is_a_config_error():
    msg = _error(DEFAULT, ["model.num_classes=5"])
    assert msg.startswith("override model.num_classes=5: the training data has 10 classes "
                          "(data.num_classes)"), msg
    assert "model.num_classes=null" in msg
    assert "data.num_classes=10" not in _error(DEFAULT, ["model.num_classes=8",
                                                         "data.num_classes=9"])
    # as many or more outputs than classes train (a fine-tune may keep a larger head)
    assert load_config(DEFAULT, ["model.num_classes=10"]).model.num_classes == 10
    assert load_config(DEFAULT, ["model.num_classes=12"]).model.num_classes == 12
    # image-text pairs and captioning VLMs have no class head
    load_config(ROOT / "configs" / "clip-tiny-shapes.yaml", ["model.num_classes=2"])
    load_config(ROOT / "configs" / "vlm-tiny-shapes.yaml", ["model.num_classes=2"])


def test_a_head_smaller_than_a_folders_classes_stops_before_the_model(tmp_path, capsys,
                                                                       monkeypatch):
    write_photos(tmp_path / "data", 4, [(16, 16)])  # two classes
    (tmp_path / "data" / "train" / "c2").mkdir()
    (tmp_path / "data" / "train" / "c2" / "x.jpg").write_bytes(
        (tmp_path / "data" / "train" / "c0" / "0.jpg").read_bytes())
    built = []
    monkeypatch.setattr("vitgraph.tasks.classification.ClassificationTask.build_model",
                        lambda self, *a, **k: built.append(1))
    code = main(["train", str(DEFAULT), "data.kind=imagefolder", f"data.path={tmp_path / 'data'}",
                 "model.spec=torch", "train.steps=1", "model.num_classes=2",
                 "train.global_batch_size=4", "train.micro_batch_size=4",
                 f"run.dir={tmp_path / 'run'}", "train.tensorboard=false"])
    err = capsys.readouterr().err
    assert code == 2 and not built, err
    assert "config error: model.num_classes=2: the training data has 3 classes (data.kind=" \
           "imagefolder" in err, err
    assert class_count(load_config(DEFAULT, ["data.kind=imagefolder",
                                             f"data.path={tmp_path / 'data'}"]).data) == 3


# ---------------------------------------------------------------- data.path with the shapes

def test_data_path_with_the_shapes_is_an_error_naming_both_keys(tmp_path):
    msg = _error(DEFAULT, [f"data.path={tmp_path}"])
    assert msg.startswith(f"override data.path={str(tmp_path)!r}: unused: data.kind=shapes"), msg
    assert "data.kind=imagefolder" in msg and "data.kind=webdataset" in msg
    own = _write(tmp_path / "own.yaml", f"base: {DEFAULT}\ndata:\n  path: {tmp_path}\n")
    assert _error(own).startswith(f"{own} (base {DEFAULT}): data.path=")
    # both on one command line
    assert "override data.path='/x': unused" in _error(B16, ["data.kind=shapes", "data.path=/x"],
                                                       data=False)


def test_data_kind_shapes_given_on_the_command_line_replaces_the_files_folder(tmp_path):
    folder = _write(tmp_path / "own.yaml", f"base: {B16}\ndata:\n  path: {tmp_path}\n")
    cfg = load_config(folder, ["data.kind=shapes"], data=False)
    assert cfg.data.kind == "shapes" and cfg.data.path is None
    # docs/vlm.md's plan line
    load_config(ROOT / "configs" / "vlm-so400m16-native.yaml", ["data.kind=shapes"], data=False)
    for path in sorted((ROOT / "configs").glob("*.yaml")):  # no shipped config has the mix
        load_config(path, data=False)


# ---------------------------------------------------------------- run.dir

def test_a_run_dir_that_cannot_be_made_is_a_config_error_before_anything(tmp_path, capsys):
    a_file = _write(tmp_path / "a_file", "x")
    for value, why in ((a_file, f"the run folder {a_file} is a file"),
                       (a_file / "run",
                        f"the run folder {a_file / 'run'} cannot be made: {a_file} is a file")):
        cfg = load_config(DEFAULT, [f"run.dir={value}"])
        with pytest.raises(ConfigError) as e:
            validate_machine(cfg)
        assert str(e.value) == f"override run.dir={str(value)!r}: {why}"
    if Path("/sys").is_dir():  # refuses even root, whom the permission bits let through
        with pytest.raises(ConfigError, match=r"override run.dir='/sys/vitgraph-run': the run "
                                              r"folder /sys/vitgraph-run cannot be made: /sys"):
            validate_machine(load_config(DEFAULT, ["run.dir=/sys/vitgraph-run"]))
    fresh = tmp_path / "new" / "deeper"
    validate_machine(load_config(DEFAULT, [f"run.dir={fresh}", "model.spec=torch"]))
    assert not (tmp_path / "new").exists() and sorted(tmp_path.iterdir()) == [a_file]
    # through the CLI: exit 2, one line, no folder
    assert main(["train", str(DEFAULT), f"run.dir={a_file / 'run'}", "model.spec=torch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitgraph: config error: override run.dir=") and "Traceback" not in err


def test_an_override_is_named_by_checks_made_after_loading(tmp_path):
    import torch
    from vitgraph.models.specs import te_available
    if torch.cuda.is_available() and te_available():
        pytest.skip("model.spec=te is fine here")
    with pytest.raises(ConfigError, match=r"^override model.spec='te': needs CUDA"):
        validate_machine(load_config(DEFAULT, ["model.spec=te"]))
    own = _write(tmp_path / "own.yaml", f"base: {DEFAULT}\nmodel:\n  spec: te\n")
    with pytest.raises(ConfigError, match=rf"^{own} \(base {DEFAULT}\): model.spec='te'"):
        validate_machine(load_config(own))


# ---------------------------------------------------------------- the run's length

def test_steps_and_epochs_on_one_command_line_are_an_error():
    msg = _error(DEFAULT, ["train.steps=3", "train.epochs=1"])
    assert msg == ("override 'train.steps=3' and override 'train.epochs=1': give exactly one "
                   "of train.steps and train.epochs")
    # one of them replaces the file's other (docs: the file's steps overridden by epochs)
    cfg = load_config(DEFAULT, ["train.epochs=1"])
    assert (cfg.train.steps, cfg.train.epochs) == (None, 1.0)
    cfg = load_config(DEFAULT, ["train.epochs=2", "train.epochs=1"])
    assert (cfg.train.steps, cfg.train.epochs) == (None, 1.0)
    cfg = load_config(DEFAULT, ["train.epochs=1", "train.steps=7", "train.epochs=null"])
    assert (cfg.train.steps, cfg.train.epochs) == (7, None)


# ---------------------------------------------------------------- the file itself

def test_an_empty_file_a_directory_and_a_key_given_twice_are_named(tmp_path):
    empty = _write(tmp_path / "empty.yaml", "")
    assert _error(empty).startswith(f"{empty}: the file is empty")
    comments = _write(tmp_path / "comments.yaml", "# nothing yet\n")
    assert _error(comments).startswith(f"{comments}: the file is empty")
    (tmp_path / "folder").mkdir()
    assert _error(tmp_path / "folder").startswith(f"{tmp_path / 'folder'}: is a directory")
    twice = _write(tmp_path / "twice.yaml", "train:\n  steps: 5\n  log_every: 1\n  steps: 7\n")
    assert _error(twice) == (f"{twice}: line 4: key 'steps' given twice (first on line 2); "
                             "YAML would keep the last")
    sections = _write(tmp_path / "sections.yaml", "train:\n  steps: 5\ntrain:\n  epochs: 1\n")
    assert _error(sections).startswith(f"{sections}: line 3: key 'train' given twice")
    child = _write(tmp_path / "child.yaml", "base: twice.yaml\n")
    assert _error(child).startswith(f"{twice}: line 4: key 'steps'")
    same_name = _write(tmp_path / "ok.yaml", f"base: {DEFAULT}\ntrain:\n  steps: 5\nrun:\n  "
                       "name: steps\n")
    assert load_config(same_name).train.steps == 5  # one key in each mapping: fine


# ---------------------------------------------------------------- `vitgraph plan`

def test_plan_counts_the_head_of_the_datas_classes(capsys):
    total = sum(p.numel for p in model_of(DEFAULT).params)
    assert main(["params", str(DEFAULT)]) == 0
    assert f"{total:,} elements" in capsys.readouterr().out.splitlines()[-1]
    assert total == 208_074  # configs/vit-tiny-shapes.yaml's header: 0.2M


def test_plan_needs_no_bpe_and_a_run_names_the_clip_extra(monkeypatch):
    missing = "the regex package (pip install -e .[clip])"
    monkeypatch.setattr(vitgraph.config, "available", lambda: missing)
    assert sum(p.numel for p in model_of(ROOT / "configs" / "clip-b16.yaml").params) > 1e8
    load_config(ROOT / "configs" / "vlm-so400m16-native.yaml", ["data.kind=shapes"], data=False)
    assert _error(ROOT / "configs" / "vlm-tiny-shapes.yaml", ["lm.tokenizer=bpe"]) == (
        f"override lm.tokenizer='bpe': CLIP's BPE needs {missing}; or use lm.tokenizer=byte")
    assert missing in _error(ROOT / "configs" / "clip-b16.yaml", ["data.kind=shapes"])
    monkeypatch.setattr(bpe.importlib.util, "find_spec", lambda name: None)
    assert bpe.available() == missing
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert "regex" in extras["clip"] and "open_clip_torch" in extras["clip"]
    assert "pip install -e .[clip]" in (ROOT / "README.md").read_text()


def test_the_log_line_says_gpu_only_where_it_has_an_mfu():
    r = {"step": 1, "loss": 1.0, "train_top1": 0.5, "lr": 1e-3, "grad_norm": 1.0,
         "images_per_s": 10.0, "tflops_per_gpu": 0.01, "peak_mem_gib": 0.5}
    assert "0.01 TFLOP/s/device | mem" in train_line(r, 10, 1.0)
    assert "0.01 TFLOP/s/gpu | MFU 1.0%" in train_line({**r, "mfu": 0.01}, 10, 1.0)


def test_a_timm_teacher_without_timm_is_a_config_error(monkeypatch):
    """A random-init timm teacher needs timm (the test extra): said at the config, exit 2,
    not as a ModuleNotFoundError after the run folder is made."""
    import importlib.util
    over = ["train.distill.teacher=timm:vit_tiny_patch16_224"]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "timm" else real(name, *a))
    msg = _error(DEFAULT, over)
    assert msg.startswith("override train.distill.teacher='timm:vit_tiny_patch16_224': needs the "
                          "timm package"), msg
