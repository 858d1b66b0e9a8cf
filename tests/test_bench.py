"""scripts/bench.py's pieces that need no GPU."""
import importlib.util
import json
import math
import types

import pytest

from conftest import ROOT


def load_bench():
    spec = importlib.util.spec_from_file_location("bench", ROOT / "scripts" / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_samples_give_power_clock_and_the_share_at_the_power_cap():
    bench = load_bench()
    lines = ["650.5, 1710, 0x0000000000000004", "[N/A], 1980, 0x0000000000000000",
             "630.5, 1680, 0x0000000000000004", "100.0, 1980, 0x0000000000000000", "garbage"]
    s = bench.summarize_gpu_samples(lines)
    assert s == {"gpu_power_w": 460.3, "gpu_sm_clock_mhz": 1710.0, "gpu_power_capped": 0.67,
                 "gpu_samples": 3}
    assert bench.summarize_gpu_samples([]) == {}


def test_no_nvidia_smi_or_gpu_samples_nothing():
    bench = load_bench()
    with bench.GpuSampler() as gpu:
        pass
    assert gpu.summary() == {}


def test_data_runs_each_vitgraph_row_again_from_shards_and_the_peers_once():
    args = types.SimpleNamespace(micro_batches=[8, 256], precisions=["bf16"],
                                 systems=["vitgraph+step-graphs", "timm+compile"], data="/shards")
    bench = load_bench()
    jobs = bench._jobs(args)
    assert [j for j in jobs if j[0] == 256] == [
        (256, "vitgraph+step-graphs", "bf16", "synthetic", "none"),
        (256, "vitgraph+step-graphs", "bf16", "shards", "none"),
        (256, "timm+compile", "bf16", "synthetic", "none")]
    args.data = None
    assert all(j[3] == "synthetic" for j in bench._jobs(args)) and len(bench._jobs(args)) == 4


def test_recompute_rows_and_per_system_micro_batches():
    """--recompute repeats each vitgraph row; timm's checkpointing row is its full recompute;
    --system-batches keeps a system to its own micro-batches."""
    args = types.SimpleNamespace(micro_batches=[128, 256], precisions=["bf16"],
                                 systems=["vitgraph+step-graphs", "timm+compile",
                                          "timm+compile+checkpointing"],
                                 recompute=["none", "full"],
                                 system_batches=["timm+compile=128",
                                                 "timm+compile+checkpointing=256"])
    jobs = load_bench()._jobs(args)
    assert [(j[0], j[1], j[4]) for j in jobs] == [
        (128, "vitgraph+step-graphs", "none"), (128, "vitgraph+step-graphs", "full"),
        (128, "timm+compile", "none"),
        (256, "vitgraph+step-graphs", "none"), (256, "vitgraph+step-graphs", "full"),
        (256, "timm+compile+checkpointing", "full")]


def test_a_config_as_shipped_runs_its_window_of_the_shipped_schedule(tmp_path):
    """--configs: the config trains in a process of its own with its own warm-up (a fraction
    of train.steps here, made explicit), and is stopped by SIGTERM (exit 75, nothing saved)
    once its window's steps are logged; the row says how far the warm-up got and whether the
    window's losses fell."""
    bench = load_bench()
    row = bench.bench_config(ROOT / "configs" / "vit-tiny-shapes.yaml", None, 10, 120,
                             tmp_path, microbatches=1)
    assert row["exit"] == 75 and "error" not in row, row
    assert 10 <= row["steps"] < 20 and row["warmup_steps"] == 225  # 0.05 x 4500 steps
    assert row["lr_share_of_peak"] == row["steps"] / 225
    assert row["window_samples"] == 32 * row["steps"] and row["warmup_samples"] == 225 * 32
    assert "optim.warmup_steps=225" in row["overrides"] and row["images_per_s"] > 0
    losses = row["losses"]
    third = max(1, len(losses) // 3)
    assert len(losses) >= 2 and row["loss_fell"] == (
        sum(losses[-third:]) < 0.98 * sum(losses[:third]))
    # a classifier's window that did not fall and sits at ln(classes) says so
    at_uniform = abs(sum(losses[-third:]) / third - math.log(10)) <= 0.005 * math.log(10)
    assert ("ln 10 = 2.3026" in row["window"]) == (at_uniform and not row["loss_fell"]), row
    assert not (tmp_path / "vit-tiny-shapes" / "checkpoints").exists() or not any(
        (tmp_path / "vit-tiny-shapes" / "checkpoints").iterdir())
    assert row["fits"]
    # a run `vitgraph plan` says does not fit the GPU is not started: the row says why
    small = bench.bench_config(ROOT / "configs" / "vit-tiny-shapes.yaml", None, 10, 120,
                               tmp_path / "small", microbatches=1, gpu_mem=0.01)
    assert small["fits"] is False and "does not fit" in small["error"], small
    assert "DOES NOT FIT" in small["error"] and not (tmp_path / "small").exists()


def test_every_bundled_gpu_config_takes_its_as_shipped_overrides(tmp_path):
    """--configs all: each GPU config loads with the window's overrides, its own warm-up kept
    and train.steps far past the window (an epoch-counted config included: an extra
    train.epochs=null once dropped the steps too, and every classifier row failed)."""
    from vitgraph.config import load_config
    bench = load_bench()
    for split in ("train", "val"):
        (tmp_path / "data" / split).mkdir(parents=True)
    configs = bench.bundled_gpu_configs()
    assert any(load_config(p, ["data.kind=shapes"]).train.epochs for p in configs)
    for path in configs:
        _, over, steps, warmup, _ = bench.shipped_window(path, str(tmp_path / "data"), None, 2,
                                                         tmp_path / path.stem)
        run = load_config(path, over)
        assert run.train.steps >= 100 * steps and run.train.epochs is None, path
        assert run.optim.warmup_steps == warmup and steps == max(150, warmup // 4), path
        # the recipe row: the bench's row (recipe off) given the config's recipe back
        cfg = load_config(path, ["data.kind=shapes"])
        row = load_config(ROOT / "configs" / "vit-b16-imagefolder.yaml", [
            f"model.name={cfg.model.name}", "data.kind=shapes", "data.augment.enabled=false",
            "train.label_smoothing=0", "optim.clip_grad=1.0", *bench.recipe_overrides(cfg)])
        for part in ("data.augment", "model.drop_path_rate", "train.ema.decay",
                     "train.label_smoothing", "optim.clip_grad"):
            got, want = row, cfg
            for name in part.split("."):
                got, want = getattr(got, name), getattr(want, name)
            assert got == want, (path, part)
        # its bench rows run at its activation recompute (the 6B tower fits only with it)
        if cfg.data.resolution != "native":
            seen = []
            bench.bench_vitgraph = lambda *a, **k: seen.append(a[8]) or {"images_per_s": 1.0}
            args = types.SimpleNamespace(warmup=1, iters=1, num_classes=10, override=[])
            for _, run_row in bench.config_bench_rows(cfg, 2, args):
                run_row()
            for over in seen:
                row = load_config(ROOT / "configs" / "vit-b16-imagefolder.yaml",
                                  ["data.kind=shapes", *over])
                assert row.train.recompute == cfg.train.recompute, path
    assert load_config(ROOT / "configs" / "vit-6b-imagefolder.yaml",
                       ["data.kind=shapes"]).train.recompute == "full"


def test_vlm_rows_give_samples_real_tokens_and_the_towers_share(tmp_path, monkeypatch):
    """--vlm: a pico tower + a one-layer GPT as a caption run, packed (layer graphs, the CPU
    rerun backend) and dense (the fixed composition at the max_patches grid), each with the
    tower alone on the same images; the JSON's rows and provenance."""
    import sys
    bench = load_bench()
    out = tmp_path / "vlm.json"
    monkeypatch.setattr(sys, "argv", [
        "bench.py", "--vlm", "--models", "vit_pico_patch4_32", "--max-patches", "16",
        "--images", "16", "--pack-tokens", "128", "--packs-per-step", "1", "--timm-batch", "4",
        "--systems", "vitgraph+packed+graphs", "vitgraph+dense",
        "--lm-layers", "1", "--lm-width", "32", "--lm-heads", "2", "--lm-tokenizer", "byte",
        "--text-length", "12", "--min-text", "4", "--warmup", "1", "--iters", "1",
        "--override", "model.spec=torch", "train.precision=fp32", "--out", str(out)])
    assert bench.main() == 0
    data = json.loads(out.read_text())
    prov = data["provenance"]
    assert prov["vlm"]["lm_layers"] == 1 and prov["native"]["images"] == 16
    packed, dense = data["rows"]
    for r in (packed, dense):
        assert r["error"] is None and r["task"] == "caption", r
        assert r["images_per_s"] > 0 and 0 < r["real_share"] <= 1 and r["tower_share"] > 0
        assert r["lm"] == {"layers": 1, "width": 32, "heads": 2, "tokenizer": "byte",
                           "text_length": 12, "min_length": 4}
        assert r["tower_alone"]["sec_per_step"] > 0
    assert packed["attention"] == "thd" and packed["graphs"] == "layer"
    assert packed["graph_stats"] and packed["pack_tokens"] == 128
    assert dense["attention"] == "dense" and dense["graphs"] is False
    assert dense["image_size"] == 16 and dense["batch"] == 4  # 4 x 4 patches of 4 pixels
    # real tokens: the images' patches and the captions' BOS to EOS, of what was computed
    cap = bench.Captions(1, 32, 2, "byte", 12, 4)
    assert {cap.length(i) for i in range(16)} <= set(range(4, 13))


def test_a_native_caption_config_is_held_against_its_own_packs_captions_and_lm():
    """--configs for a config at native resolution with a language model (the VLM's): its
    bench rows run its packs over a stream of its data's image sizes (each at the grid it
    trains at) with the data's captions, through its own lm keys; a caption's real tokens are
    BOS to EOS of its ids."""
    import argparse
    from vitgraph.config import load_config
    from vitgraph.data import build_datasets
    from vitgraph.data.packing import native_grid
    from vitgraph.text import make_tokenizer
    bench = load_bench()
    cfg = load_config(ROOT / "configs" / "vlm-tiny-shapes-native.yaml",
                      ["data.num_train=48", "data.num_val=8"])
    grids, texts = bench.config_stream(cfg, 24, seed=3)
    train, _ = build_datasets(cfg.data, cfg.train.seed, native=True)
    p = cfg.data.packing
    pairs = {(native_grid(h, w, 4, p.max_patches, p.min_patches), c)
             for (h, w), c in zip(train.sizes.tolist(), train.captions)}
    assert len(grids) == len(texts) == 24 and set(zip(grids, texts)) <= pairs
    assert len(set(grids)) > 1  # the data's sizes, not one square grid
    tok = make_tokenizer("byte", 259, 8)
    ids = bench.Captions(1, 8, 1, "byte", 8, 3, texts=("ab", "a much longer caption"))
    assert bench.caption_lengths(ids.ids(tok, 3), tok) == [4, 8, 4]  # cut: EOS kept
    args = argparse.Namespace(images=200, seed=3, warmup=1, iters=1, num_classes=10,
                              override=["model.spec=torch", "train.precision=fp32"])
    rows = bench.config_bench_rows(cfg, 1, args)
    assert [name for name, _ in rows] == ["vitgraph+packed+graphs",
                                          "vitgraph+packed+step-graphs", "recipe"]
    assert rows[0][1]() > 0


def test_a_configs_run_cut_in_its_bench_rows_keeps_the_as_shipped_row(tmp_path):
    """--configs under a time limit (SIGINT) that ends the bench rows: the JSON already holds
    the config's as-shipped row (a big tower's window and rows can outlast a device call)."""
    bench = load_bench()
    shipped = {"config": "configs/vit-g14-imagefolder.yaml", "fits": True, "images_per_s": 1.5}
    bench.bench_config = lambda *a, **k: dict(shipped)
    bench.provenance = lambda args: {"command": "test"}

    def cut():
        raise KeyboardInterrupt
    bench.config_bench_rows = lambda *a, **k: [("vitgraph+graphs", cut)]
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
    out = tmp_path / "configs.json"
    args = types.SimpleNamespace(configs=[ROOT / "configs" / "vit-g14-imagefolder.yaml"],
                                 imagefolder=str(tmp_path), shards=str(tmp_path), steps=None,
                                 window_s=1, out=out)
    with pytest.raises(KeyboardInterrupt):
        bench.run_configs(args)
    assert json.loads(out.read_text())["rows"] == [shipped]
