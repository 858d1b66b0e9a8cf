"""The commands around training: eval, export, configs, cache, --version, usage."""
import hashlib
import json
import subprocess

import pytest
import torch

from vitgraph.cli import main

from conftest import ROOT, clean_env, tiny_overrides, vitgraph_cmd, world_of_one

dist1 = world_of_one("torch")


def run(env, *args, check=True):
    p = subprocess.run(vitgraph_cmd(*args), env=env, capture_output=True, text=True, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"{args}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def snapshot(run_dir):
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, env_module):
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    run(env_module, "train", str(ROOT / "configs" / "vit-tiny-shapes.yaml"),
        *tiny_overrides(run_dir, steps=12, **{"data.cache_dir": "null"}))
    return run_dir


@pytest.fixture(scope="module")
def env_module():
    return clean_env()


def test_version_configs_usage_and_cache(env, tmp_path, capsys):
    from vitgraph import __version__
    assert run(env, "--version").stdout.strip() == f"vitgraph {__version__}"
    assert main(["configs"]) == 0
    out = capsys.readouterr().out
    for f in sorted((ROOT / "configs").glob("*.yaml")):
        assert f"configs/{f.name}" in out
    assert "ViT-B/16 at 224" in out
    assert main(["train"]) == 2 and "usage: vitgraph train" in capsys.readouterr().err
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "shapes_v1_train_0123.npz").write_bytes(b"x" * 2**20)
    (cache / "keep.txt").write_text("not ours")
    assert main(["cache", "--dir", str(cache)]) == 0
    assert "1 cached datasets, 1.0 MB" in capsys.readouterr().out
    assert main(["cache", "--clear", "--dir", str(cache)]) == 0
    assert "removed 1" in capsys.readouterr().out
    assert sorted(p.name for p in cache.iterdir()) == ["keep.txt"]


def test_eval_writes_only_its_json(trained, env_module):
    before = snapshot(trained)
    metrics = json.loads((trained / "metrics.json").read_text())
    out = run(env_module, "eval", str(trained / "config.yaml")).stdout.strip().splitlines()[-1]
    assert out == str(trained / "eval-12.json")
    result = json.loads((trained / "eval-12.json").read_text())
    assert result["step"] == 12 and result["eval_images"] == 200
    assert result["eval_top1"] == pytest.approx(metrics["eval_top1"])
    assert result["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-5)
    run(env_module, "eval", str(trained / "config.yaml"), "--split", "train", "--checkpoint", "12")
    train_eval = json.loads((trained / "eval-12-train.json").read_text())
    assert train_eval["split"] == "train" and train_eval["eval_images"] == 512
    after = snapshot(trained)
    assert set(after) - set(before) == {"eval-12.json", "eval-12-train.json"}
    assert {k: after[k] for k in before} == before  # nothing of the run changed

def test_eval_of_a_missing_checkpoint_names_it(trained, capsys):
    assert main(["eval", str(trained / "config.yaml"), "--checkpoint", "7"]) == 2
    assert "step_000007" in capsys.readouterr().err


def test_export_timm_and_hf_load_back_with_the_same_logits(trained, dist1, tmp_path, capsys):
    from vitgraph.config import load_config
    from vitgraph.convert import load_into_model, read_checkpoint_weights
    from vitgraph.parallel.setup import build_model
    cfg = load_config(trained / "config.yaml")
    ours = build_model(cfg, dist1, 10)[0].eval()
    load_into_model(ours, read_checkpoint_weights(trained)[0])
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = ours(x)

    assert main(["export", str(trained), "--format", "timm", "--out", str(tmp_path / "t.safetensors")]) == 0
    import timm
    from safetensors.torch import load_file
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4,
                            embed_dim=64, depth=4, num_heads=4, num_classes=10).eval()
    ref.load_state_dict(load_file(tmp_path / "t.safetensors"), strict=True)
    with torch.no_grad():
        got = ref(x)
    assert ((got - want).abs().max() / want.abs().max()) <= 1e-4 and want.abs().max() > 0

    assert main(["export", str(trained), "--format", "hf", "--out",
                 str(tmp_path / "hf" / "model.safetensors")]) == 0
    from transformers import ViTForImageClassification
    hf = ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        got = hf(pixel_values=x).logits
    # vitgraph trained with eps 1e-6; the exported config carries it
    assert ((got - want).abs().max() / want.abs().max()) <= 1e-4

    assert main(["export", str(trained), "--out", str(tmp_path / "v.safetensors")]) == 0
    sd = load_file(tmp_path / "v.safetensors")
    assert "decoder.layers.3.mlp.linear_fc2.weight" in sd
    capsys.readouterr()
    assert main(["export", str(trained), "--format", "open_clip", "--out",
                 str(tmp_path / "o.safetensors")]) == 2  # a classifier: no open_clip form
    err = capsys.readouterr().err
    assert "classifier ViT cannot be written as open_clip" in err and "ln_pre" in err
    assert not (tmp_path / "o.safetensors").exists()
