"""The commands around training: eval, export, configs, cache, --version, usage."""
import hashlib
import json
import os
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from vitgraph.cli import main

from conftest import ROOT, clean_env, tiny_overrides, vitgraph_cmd, world_of_one

dist1 = world_of_one("torch")


def run(env, *args):
    p = subprocess.run(vitgraph_cmd(*args), env=env, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise AssertionError(f"{args}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def here(capsys, *args) -> tuple[int, str, str]:
    """``vitgraph ARGS`` in this process (no interpreter start-up): (exit code, out, err)."""
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(run_dir):
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    assert main(["train", str(ROOT / "configs" / "vit-tiny-shapes.yaml"),
                 *tiny_overrides(run_dir, steps=12, **{"data.cache_dir": "null"})]) == 0
    return run_dir


def test_version_configs_usage_and_cache(tmp_path, capsys):
    from vitgraph import __version__
    from importlib.metadata import version
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    out = capsys.readouterr().out.strip()
    assert done.value.code == 0 and out.startswith(f"vitgraph {__version__} (torch "), out
    assert f"torch {torch.__version__}" in out and f"megatron-core {version('megatron-core')}" \
        in out and "transformer-engine " in out, out
    assert main(["configs"]) == 0
    out = capsys.readouterr().out
    for f in sorted((ROOT / "configs").glob("*.yaml")):
        assert f"configs/{f.name}" in out
    assert "ViT-B/16 at 224" in out
    # a header's first sentence, not cut at an abbreviation's full stop
    assert 'DeiT-B (Touvron et al. 2021, "Training data-efficient image transformers"' in out
    assert "bf16 with TE layers on GPUs\n" in out  # ... and cut at the sentence's end
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "shapes_v1_train_0123.npz").write_bytes(b"x" * 2**20)
    (cache / "keep.txt").write_text("not ours")
    assert main(["cache", "--dir", str(cache)]) == 0
    assert "1 cached dataset split, 1.0 MB" in capsys.readouterr().out
    assert main(["cache", "--clear", "--dir", str(cache)]) == 0
    assert "removed 1" in capsys.readouterr().out
    assert sorted(p.name for p in cache.iterdir()) == ["keep.txt"]


def test_a_missing_argument_or_folder_is_one_line_exit_2(tmp_path, capsys):
    """What the user left out or mistyped is named in one line, exit 2, nothing done."""
    with pytest.raises(SystemExit) as done:
        main(["train"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "usage: vitgraph train [-h] config [overrides ...]" in err
    assert err.strip().splitlines()[-1] == ("vitgraph train: error: the following arguments are "
                                            "required: config")
    (tmp_path / "a-file").write_text("")
    for given, what in ((tmp_path / "typo", "does not exist"), (tmp_path / "a-file",
                                                                 "is not a folder")):
        code, out, err = here(capsys, "cache", "--dir", str(given))
        assert code == 2 and out == "" and err == f"vitgraph: cache: --dir {given}: {what}\n"
    code, _, err = here(capsys, "cache", "--clear", "--dir", str(tmp_path / "typo"))
    assert code == 2 and "does not exist" in err


def test_models_lists_classifiers_and_image_text_pairs(capsys):
    from vitgraph.models.registry import ALIASES, CLIP_MODELS, MODELS
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    classifiers, pairs = out.split("image-text pairs")
    assert classifiers.startswith("classifiers")
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("  ")}
    assert listed == set(MODELS) | set(ALIASES) | set(CLIP_MODELS)
    assert all(f"  {name} " in pairs for name in CLIP_MODELS)
    assert "  siglip_vit_b16 " in pairs and "context 64" in pairs


@pytest.mark.parametrize("command", [["models"], ["--version"]])
def test_a_closed_pipe_ends_the_command_quietly(command):
    """`vitgraph models | head`: the reader goes away, the command stops with 141 (128 +
    SIGPIPE, as a shell reports it) and no traceback (there were two, or an ignored
    exception at exit, code 120)."""
    env = clean_env()
    env.pop("PYTHONUNBUFFERED", None)  # stdout block-buffered, as a plain shell has it
    p = subprocess.Popen(vitgraph_cmd(*command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env, cwd=ROOT)
    p.stdout.close()  # before the first line is written
    err = p.stderr.read().decode()
    assert p.wait() == 141 and err == ""


def test_eval_writes_only_its_json(trained, capsys):
    lines = []

    def evaluate(*args) -> str:
        code, out, err = here(capsys, "eval", str(trained / "config.yaml"), *args)
        assert code == 0, err[-3000:]
        line, = out.splitlines()  # what it scored, the metrics and the file, said once
        lines.append(line)
        return line.rsplit(" -> ", 1)[1]

    before = snapshot(trained)
    metrics = json.loads((trained / "metrics.json").read_text())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")  # as a command shows them, past pytest's filters
        out = evaluate()
    # torch's ShardedTensor / load_state_dict deprecations, said on every checkpoint read
    assert not [str(w.message) for w in said if issubclass(w.category, FutureWarning)
                or "torch.distributed is disabled" in str(w.message)], said
    assert out == str(trained / "eval-12.json")
    assert "global batch 32 = 1 microbatch x 32 x dp 1" in (trained / "train.log").read_text()
    assert f"eval of {trained / 'checkpoints' / 'step_000012'} (shapes val, 200 images): top1 " \
        in lines[0], lines
    result = json.loads((trained / "eval-12.json").read_text())
    assert result["step"] == 12 and result["eval_images"] == 200
    assert result["data"] == {"kind": "shapes", "path": None, "split": "val", "images": 200}
    assert result["eval_top1"] == pytest.approx(metrics["eval_top1"])
    assert result["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-5)
    evaluate("--split", "train", "--checkpoint", "12")
    train_eval = json.loads((trained / "eval-12-train.json").read_text())
    assert train_eval["split"] == "train" and train_eval["eval_images"] == 512
    assert train_eval["data"]["split"] == "train" and train_eval["data"]["images"] == 512
    own = (trained / "eval-12.json").read_text()
    # other data (here fewer held-out images): a file of its own, the run's eval kept
    other = evaluate("data.num_val=100")
    assert other.startswith(str(trained / "eval-12-shapes-")) and other.endswith(".json")
    assert json.loads(open(other).read())["data"]["images"] == 100
    assert (trained / "eval-12.json").read_text() == own
    after = snapshot(trained)
    assert set(after) - set(before) == {"eval-12.json", "eval-12-train.json",
                                        other[len(str(trained)) + 1:]}
    assert {k: after[k] for k in before} == before  # nothing of the run changed

def test_eval_of_a_missing_checkpoint_names_it(trained, capsys):
    assert main(["eval", str(trained / "config.yaml"), "--checkpoint", "7"]) == 2
    assert "step_000007" in capsys.readouterr().err


def test_a_run_folder_named_is_that_folder_wherever_it_was_trained(trained, tmp_path, capsys):
    """A copied (or moved) run keeps the run.dir of where it trained in its config.yaml: eval
    and export of the copy read and write the copy, never the original."""
    import shutil

    from vitgraph.config import load_config, run_model_config
    copy = tmp_path / "copy"
    shutil.copytree(trained, copy)
    assert load_config(copy).run_dir == copy == Path(run_model_config(copy)[1]["run"]["dir"])
    before = snapshot(trained)
    code, out, err = here(capsys, "eval", str(copy))
    assert code == 0, err[-3000:]
    assert out.endswith(f" -> {copy / 'eval-12.json'}\n") and str(trained) not in out, out
    code, out, err = here(capsys, "export", str(copy), "--out", str(tmp_path / "w.safetensors"))
    assert code == 0 and f"from checkpoint {copy / 'checkpoints' / 'step_000012'} " in out, err
    assert snapshot(trained) == before
    code, _, err = here(capsys, "export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x"))
    assert code == 2 and err == (f"vitgraph: export: {tmp_path / 'nowhere'}: not a run folder "
                                 f"(no config.yaml in it)\n")


def umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_export_out_is_a_file_or_a_folder_and_a_bad_one_is_one_line(trained, tmp_path, capsys,
                                                                     monkeypatch):
    """--out FILE.safetensors, or a folder (existing or not) that gets model.safetensors and
    the side files; every file with the mode the umask gives (as the run's own files), the
    checkpoint's model.safetensors too; a destination that cannot be written: one line naming
    it, exit 2, nothing half-written."""
    import safetensors.torch
    from safetensors import SafetensorError
    mode = 0o666 & ~umask()
    assert (trained / "checkpoints" / "step_000012" / "model.safetensors").stat().st_mode \
        & 0o777 == mode == (trained / "config.yaml").stat().st_mode & 0o777
    existing = tmp_path / "existing"
    existing.mkdir()
    for out, fmt in ((existing, "timm"), (tmp_path / "new" / "noext", "hf"),
                     (tmp_path / "w.safetensors", "vitgraph")):
        code, said, err = here(capsys, "export", str(trained), "--format", fmt, "--out", str(out))
        weights = out if out.suffix == ".safetensors" else out / "model.safetensors"
        assert code == 0 and said.startswith(f"{weights}: "), err
        written = sorted(p.name for p in weights.parent.iterdir())
        assert written == {"timm": ["config.json", "model.safetensors"],
                           "hf": ["config.json", "model.safetensors", "preprocessor_config.json"],
                           "vitgraph": ["existing", "new", "w.safetensors"]}[fmt]
        assert all(p.stat().st_mode & 0o777 == mode for p in weights.parent.iterdir()
                   if p.is_file())
    from vitgraph.output import written_whole
    old = os.umask(0o002)  # the umask decides, whatever it is
    try:
        with written_whole(tmp_path / "group.json") as tmp:
            tmp.write_text("{}")
    finally:
        os.umask(old)
    assert (tmp_path / "group.json").stat().st_mode & 0o777 == 0o664

    (tmp_path / "a-file").write_text("")
    bad = {str(tmp_path / "a-file" / "w.safetensors"): f"{tmp_path / 'a-file'} is a file",
           str(tmp_path / "a-file"): "a file that is not .safetensors; --out is a .safetensors "
                                     "file or a folder"}
    for out, problem in bad.items():
        code, said, err = here(capsys, "export", str(trained), "--out", out)
        assert code == 2 and said == "" and err.startswith(f"vitgraph: export: --out {out}: "
                                                           f"{problem}"), err
        assert len(err.splitlines()) == 1

    def full_disk(tensors, filename, metadata=None):  # safetensors' own error, a part written
        Path(filename).write_bytes(b"x" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os "
                              "error 28)")
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    full = tmp_path / "full"
    code, said, err = here(capsys, "export", str(trained), "--out", str(full))
    assert code == 2 and said == "" and err == (
        f"vitgraph: export: --out {full}: cannot write {full / 'model.safetensors'}: No space "
        f"left on device\n")
    assert list(full.iterdir()) == []  # no .partial left


def test_eval_and_export_check_the_checkpoint_against_its_manifest(trained, tmp_path, capsys,
                                                                    caplog):
    """A damaged checkpoint named by --checkpoint is refused in one line naming the damaged
    file (eval and export); without it each passes over the damaged newest one and says
    which it read and why; with every one damaged each says what is wrong with each."""
    import shutil
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    ckpts = run / "checkpoints"
    shutil.copytree(ckpts / "step_000012", ckpts / "step_000006")  # an older intact one
    cut = ckpts / "step_000012" / "dist" / "__0_0.distcp"
    cut.write_bytes(cut.read_bytes()[:1000])
    damage = f"{cut}: 1000 bytes, the manifest says"
    evals = sorted(run.glob("eval-*"))  # an earlier test's
    for command in (["eval", str(run)], ["export", str(run), "--out", str(tmp_path / "x")]):
        code, out, err = here(capsys, *command, "--checkpoint", "12")
        assert code == 2 and out == "" and len(err.splitlines()) == 1, err
        assert f"checkpoint {ckpts / 'step_000012'} is damaged: {damage}" in err, err
    assert not (tmp_path / "x").exists() and sorted(run.glob("eval-*")) == evals
    code, out, err = here(capsys, "export", str(run), "--out", str(tmp_path / "x"))
    assert code == 0, err
    assert f"from checkpoint {ckpts / 'step_000006'} (step 12)" in out  # the copy's step
    assert err.startswith(f"vitgraph: export: checkpoint step_000012 is damaged: {damage}"), err
    with caplog.at_level("WARNING", logger="vitgraph"):  # eval passes over it the same way
        code, out, err = here(capsys, "eval", str(run))
    assert code == 0 and out.startswith(f"eval of {ckpts / 'step_000006'} "), out
    assert f"checkpoint step_000012 is damaged: {damage}" in caplog.text
    assert caplog.text.rstrip().endswith("; passing over it"), caplog.text
    (ckpts / "step_000006" / "manifest.json").unlink()
    for command in (["export", str(run), "--out", str(tmp_path / "y")], ["eval", str(run)]):
        code, out, err = here(capsys, *command)
        assert code == 2 and out == "" and len(err.splitlines()) == 1, err
        assert f"no intact checkpoint under {ckpts}: step_000012 is damaged: {damage}" in err
        assert f"step_000006 is damaged: {ckpts / 'step_000006' / 'manifest.json'}: missing" in err


def vitgraph_input(image, size):
    """vitgraph's held-out preprocessing of one PIL image: [1, 3, size, size] fp32."""
    from vitgraph.data.decode import resize_crop
    from vitgraph.data.loader import to_model_input
    return to_model_input(torch.tensor(resize_crop(image, size))[None], size, "cpu",
                          torch.float32)


def test_export_timm_and_hf_load_back_with_the_same_logits(trained, dist1, tmp_path, capsys):
    """Each export, loaded the way the README says, gives vitgraph's logits; the files beside
    it carry vitgraph's preprocessing (mean = std = 0.5, shorter side + center crop, bicubic)
    and the run's class names."""
    import numpy as np
    import timm
    from PIL import Image
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoImageProcessor, ViTForImageClassification

    from vitgraph.config import load_config
    from vitgraph.convert import load_into_model, read_checkpoint_weights
    from vitgraph.data.shapes import CLASSES
    from vitgraph.models.build import build_model
    from vitgraph.plan import resolve
    cfg = load_config(trained / "config.yaml")
    ours = build_model(resolve(cfg, dist1.world), cfg.model, dist1, 10, cfg.train.seed)[0].eval()
    from vitgraph.convert.checkpoints import checkpoint_dir
    load_into_model(ours, read_checkpoint_weights(checkpoint_dir(trained))[0])
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = ours(x)
    names = CLASSES[:10]
    assert json.loads((trained / "classes.json").read_text()) == names

    def close(got, ref=want):
        return ((got - ref).abs().max() / ref.abs().max()) <= 1e-4 and ref.abs().max() > 0

    timm_file = tmp_path / "timm" / "model.safetensors"
    assert main(["export", str(trained), "--format", "timm", "--out", str(timm_file)]) == 0
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4,
                            embed_dim=64, depth=4, num_heads=4, num_classes=10).eval()
    ref.load_state_dict(load_file(timm_file), strict=True)
    with torch.no_grad():
        assert close(ref(x))
    side = json.loads((timm_file.parent / "config.json").read_text())
    assert side["num_classes"] == 10 and side["label_names"] == names
    pc = side["pretrained_cfg"]
    assert pc["mean"] == pc["std"] == [0.5, 0.5, 0.5] and pc["input_size"] == [3, 32, 32]
    # the folder alone rebuilds the model: timm reads the sizes, weights and preprocessing
    local = timm.create_model(f"local-dir:{timm_file.parent}", pretrained=True).eval()
    with torch.no_grad():
        assert close(local(x))
    data_cfg = timm.data.resolve_data_config({}, model=local)
    assert tuple(data_cfg["mean"]) == tuple(data_cfg["std"]) == (0.5, 0.5, 0.5)
    assert data_cfg["interpolation"] == "bicubic" and data_cfg["crop_pct"] == 1.0
    assert tuple(data_cfg["input_size"]) == (3, 32, 32)
    assert local.pretrained_cfg["label_names"] == names

    hf_dir = tmp_path / "hf"
    assert main(["export", str(trained), "--format", "hf", "--out",
                 str(hf_dir / "model.safetensors")]) == 0
    hf = ViTForImageClassification.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        # vitgraph trained with eps 1e-6; the exported config carries it
        assert close(hf(pixel_values=x).logits)
    assert [hf.config.id2label[i] for i in range(10)] == names
    assert hf.config.label2id["heart"] == 9
    # the processor does to an image what vitgraph's held-out path does: a 40x32 photo is
    # center-cropped (exactly), a 96x80 one resized and cropped (within resampling's rounding)
    processor = AutoImageProcessor.from_pretrained(hf_dir)
    rng = np.random.default_rng(0)
    for (w, h), tol in (((40, 32), 1e-6), ((96, 80), 0.1)):
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        mine = vitgraph_input(image, 32)
        theirs = processor(images=image, return_tensors="pt")["pixel_values"]
        assert theirs.shape == mine.shape
        assert (theirs - mine).abs().mean() <= tol / 10 and (theirs - mine).abs().max() <= tol * 10
    image = Image.fromarray(rng.integers(0, 256, (32, 40, 3), dtype=np.uint8))
    with torch.no_grad():
        assert close(hf(**processor(images=image, return_tensors="pt")).logits,
                     ours(vitgraph_input(image, 32)))
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["classes"]) == names
    assert json.loads(meta["preprocessing"])["mean"] == [0.5, 0.5, 0.5]

    assert main(["export", str(trained), "--out", str(tmp_path / "v.safetensors")]) == 0
    sd = load_file(tmp_path / "v.safetensors")
    assert "decoder.layers.3.mlp.linear_fc2.weight" in sd
    capsys.readouterr()
    assert main(["export", str(trained), "--format", "open_clip", "--out",
                 str(tmp_path / "o.safetensors")]) == 2  # a classifier: no open_clip form
    err = capsys.readouterr().err
    assert "classifier ViT cannot be written as open_clip" in err and "ln_pre" in err
    assert not (tmp_path / "o.safetensors").exists()


def test_an_imagefolder_runs_export_names_its_classes(tmp_path, capsys):
    from PIL import Image
    data = tmp_path / "data"
    for split in ("train", "val"):
        for c, name in enumerate(("cat", "dog", "zebra")):
            (data / split / name).mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (20, 16), (90 * c, 40 * i, 30)).save(
                    data / split / name / f"{i}.png")
    run_dir = tmp_path / "run"
    code, _, err = here(capsys, "train", str(ROOT / "configs" / "vit-tiny-shapes.yaml"),
                        "data.kind=imagefolder", f"data.path={data}",
                        *tiny_overrides(run_dir, steps=2, **{"train.global_batch_size": 4,
                                                             "train.micro_batch_size": 4}))
    assert code == 0, err[-3000:]
    assert main(["export", str(run_dir), "--format", "hf", "--out",
                 str(tmp_path / "hf" / "model.safetensors")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["id2label"] == {"0": "cat", "1": "dog", "2": "zebra"}
    assert config["label2id"] == {"cat": 0, "dog": 1, "zebra": 2}
    assert main(["export", str(run_dir), "--format", "timm", "--out",
                 str(tmp_path / "timm" / "model.safetensors")]) == 0
    timm_cfg = json.loads((tmp_path / "timm" / "config.json").read_text())
    assert timm_cfg["label_names"] == ["cat", "dog", "zebra"] and timm_cfg["num_classes"] == 3
    out = capsys.readouterr().out
    assert f"{tmp_path / 'timm' / 'config.json'}: written beside them" in out  # said, not silent
    # a second model exported into that folder would replace the first's config.json
    (tmp_path / "timm" / "config.json").write_text('{"num_classes": 1000}\n')
    code, out, err = here(capsys, "export", str(run_dir), "--format", "timm", "--out",
                          str(tmp_path / "timm" / "other.safetensors"))
    assert code == 2 and "config.json exists and describes another model" in err, err
    assert not (tmp_path / "timm" / "other.safetensors").exists()
    assert (tmp_path / "timm" / "config.json").read_text() == '{"num_classes": 1000}\n'


def test_init_from_weights_of_another_size_is_exit_2_with_both_sizes(trained, tmp_path, capsys):
    """The message gives the file's and the config's sizes, what to set, and the file's own
    key names (timm's here), not vitgraph's."""
    from vitgraph.convert import from_vitgraph, read_checkpoint_weights, save_safetensors
    from vitgraph.convert.checkpoints import checkpoint_dir
    sd = read_checkpoint_weights(checkpoint_dir(trained))[0]  # 4 layers x 64
    path = save_safetensors(from_vitgraph(sd, "timm", 4), tmp_path / "w.safetensors")
    code, _, err = here(capsys, "train", str(ROOT / "configs" / "vit-tiny-shapes.yaml"),
                        f"model.init_from={path}", "model.num_layers=2",
                        *tiny_overrides(tmp_path / "run", steps=2))
    assert code == 2, err[-2000:]
    assert "holds a 4-layer, 64-wide ViT" in err and "builds a 2-layer, 64-wide ViT" in err
    assert "set model.name / model.num_layers " in err and "failed" not in err
    with_registers = dict(sd, registers=torch.zeros(1, 1, 64))
    path = save_safetensors(from_vitgraph(with_registers, "timm", 4), tmp_path / "r.safetensors")
    code, _, err = here(capsys, "train", str(ROOT / "configs" / "vit-tiny-shapes.yaml"),
                        f"model.init_from={path}", *tiny_overrides(tmp_path / "run2", steps=2))
    assert code == 2 and "unexpected key 'reg_token'" in err, err[-2000:]


def test_a_cpu_run_prints_no_warnings_of_what_is_not_installed(tmp_path):
    """megatron-core's TE / Apex notices (five modules, again in the checkpoint writer's
    spawned process) and the other warnings of a plain run stay out of the terminal."""
    env = clean_env()
    del env["PYTHONWARNINGS"]
    p = run(env, "train", str(ROOT / "configs" / "vit-tiny-shapes.yaml"),
            *tiny_overrides(tmp_path / "run", steps=2))
    for noise in ("not installed", "full scope is deprecated", "torch.distributed is disabled"):
        assert noise not in p.stderr, p.stderr[-3000:]
    assert "Warning" not in p.stderr, p.stderr[-3000:]


def test_auto_spec_on_a_gpu_without_te_says_so_once(monkeypatch, caplog):
    import logging

    from vitgraph.models import specs
    monkeypatch.setattr(specs.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(specs, "te_available", lambda: False)
    specs._say_no_te.cache_clear()
    with caplog.at_level(logging.WARNING, logger="vitgraph"):
        assert specs.resolve_spec("auto") == specs.resolve_spec("auto") == "torch"
        assert specs.resolve_spec("torch") == "torch"
    said = [r for r in caplog.records if "Transformer Engine is not installed" in r.getMessage()]
    assert len(said) == 1
    specs._say_no_te.cache_clear()


def test_checkpoint_save_false_writes_no_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["train", str(ROOT / "configs" / "vit-tiny-shapes.yaml"),
                 *tiny_overrides(run_dir, steps=3, **{"checkpoint.save": "false",
                                                      "checkpoint.every": 2})]) == 0
    assert (run_dir / "metrics.json").is_file()
    assert not any((run_dir / "checkpoints").glob("step_*"))
