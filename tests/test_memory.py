"""vitgraph plan (vitgraph.memory): the parameter count of the meta-device build is the real
model's, the per-GPU terms follow the layout (dp shards the optimizer, tp splits the matrices,
pp splits the layers and holds microbatches in flight), recompute drops what it should, the
largest micro-batch is the edge of the budget, and the CLI says what does not fit and what
would."""
import json
import os
from types import SimpleNamespace

import pytest

from vitgraph.memory import (GIB, Layout, in_flight, largest_micro_batch, layer_bytes_per_token,
                             model_of, plan_memory)
from vitgraph.models.build import Recompute

from conftest import ROOT

TINY = ROOT / "configs" / "vit-tiny-shapes.yaml"
G14 = ROOT / "configs" / "vit-g14-imagefolder.yaml"


def _cfg(path, *over):
    from vitgraph.config import load_config
    return load_config(path, list(over), data=False)


@pytest.fixture(scope="module")
def tiny():
    return model_of(TINY, ["model.spec=torch"])


@pytest.fixture(scope="module")
def g14():
    return model_of(G14, [])


def test_meta_count_is_the_built_models(tiny):
    from vitgraph.config import load_config
    from vitgraph.data import class_count
    from vitgraph.memory import SINGLE, single_process_chunks
    from vitgraph.parallel.setup import shutdown
    cfg = load_config(TINY, ["model.spec=torch", *SINGLE])
    cfg.train.global_batch_size = cfg.train.micro_batch_size
    try:  # the plan's head: the data's 10 classes (data.num_classes), not 1000
        chunks, _ = single_process_chunks(cfg, class_count(cfg.data))
        real = [(p.numel(), p.requires_grad) for p in chunks[0].parameters()]
    finally:
        shutdown()
    assert [(q.numel, q.trainable) for q in tiny.params] == real
    assert sum(q.layer is not None for q in tiny.params) == 4 * 12  # 4 layers x 12 tensors


def test_g14_has_its_registry_size(g14):
    assert sum(q.numel for q in g14.params) == pytest.approx(1.0126e9, rel=1e-3)
    assert g14.num_layers == 40 and g14.stacks[0].tokens == 257


def test_static_terms_follow_the_layout(g14):
    cfg = _cfg(G14, "train.global_batch_size=1024")
    one = plan_memory(cfg, g14, Layout()).stages[0]
    n = sum(q.numel for q in g14.params)
    assert one.params == n and one.weights == 2 * n and one.grads == 4 * n
    assert one.optimizer == pytest.approx(12 * n, rel=1e-6)
    dp8 = plan_memory(cfg, g14, Layout(dp=8)).stages[0]
    assert dp8.optimizer == pytest.approx(one.optimizer / 8, rel=1e-6)
    assert dp8.weights == one.weights and dp8.grads == one.grads
    plain = plan_memory(cfg, g14, Layout(dp=8, distributed_optimizer=False)).stages[0]
    assert plain.optimizer == one.optimizer
    tp2 = plan_memory(cfg, g14, Layout(tp=2)).stages[0]
    assert 0.5 * n < tp2.params < 0.51 * n  # norms, biases of row-parallel layers, embeddings
    pp2 = plan_memory(cfg, g14, Layout(pp=2)).stages
    assert pp2[0].params + pp2[1].params == n
    assert abs(pp2[0].params - pp2[1].params) < 0.01 * n
    off = plan_memory(_cfg(G14, "train.global_batch_size=1024", "optim.offload_fraction=0.5",
                           "graphs.enabled=auto", "checkpoint.save=false"), g14, Layout()).stages[0]
    assert off.optimizer == pytest.approx(one.optimizer / 2, rel=1e-6)
    ema = plan_memory(_cfg(G14, "train.global_batch_size=1024", "train.ema.decay=0.999"),
                      g14, Layout(dp=4)).stages[0]
    assert ema.ema == pytest.approx(4 * n / 4, rel=1e-6)


def test_activations_scale_with_the_tokens_and_recompute(g14):
    cfg = _cfg(G14)
    s = g14.stacks[0]
    per_layer = layer_bytes_per_token(s, 1, False, False)
    assert per_layer == 16 * 1408 + 4 * 6144 + 16 + 4 * 16
    a128 = plan_memory(cfg, g14, Layout(), 128).stages[0].activations
    a64 = plan_memory(cfg, g14, Layout(), 64).stages[0].activations
    assert a128 == pytest.approx(2 * a64, rel=0.01)
    assert a128 == pytest.approx(40 * per_layer * 128 * 257, rel=0.02)
    full = plan_memory(cfg, g14, Layout(), 128, Recompute("full", "uniform", 1)).stages[0]
    assert full.activations < 0.08 * a128  # the residual stream of each layer, + the embedding
    two = plan_memory(cfg, g14, Layout(), 128, Recompute("full", "uniform", 2)).stages[0]
    assert two.activations < full.activations and two.working > full.working
    block = plan_memory(cfg, g14, Layout(), 128, Recompute("full", "block", 20)).stages[0]
    assert full.activations < block.activations < a128
    mlp = plan_memory(cfg, g14, Layout(), 128, Recompute("selective", modules=("mlp",))).stages[0]
    assert mlp.activations < 0.6 * a128
    attn = plan_memory(cfg, g14, Layout(), 128,
                       Recompute("selective", modules=("core_attn",))).stages[0]
    assert attn.activations == a128  # flash attention keeps no per-pair tensors to drop
    sp = plan_memory(_cfg(G14, "parallel.tp=2", "parallel.sequence_parallel=true"), g14,
                     Layout(tp=2, sequence_parallel=True), 128).stages[0].activations
    tp = plan_memory(_cfg(G14, "parallel.tp=2"), g14, Layout(tp=2), 128).stages[0].activations
    assert sp < tp < a128


def test_pipeline_stages_hold_their_microbatches_in_flight():
    assert [in_flight(Layout(pp=4), s, 16) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight(Layout(pp=4), 0, 2) == 2
    # interleaved: (pp - stage - 1) x 2 + (vpp - 1) x pp warm-up chunk-forwards, + 1
    assert in_flight(Layout(pp=2, vpp=2), 0, 8) == 5 and in_flight(Layout(pp=2, vpp=2), 1, 8) == 3


def test_largest_micro_batch_is_the_edge_of_the_budget(g14):
    cfg = _cfg(G14)
    budget = 80 * GIB
    mb = largest_micro_batch(cfg, g14, Layout(), budget)
    assert plan_memory(cfg, g14, Layout(), mb).peak <= budget
    assert plan_memory(cfg, g14, Layout(), mb + 1).peak > budget
    assert largest_micro_batch(cfg, g14, Layout(), 10 * GIB) == 0  # the weights alone: 17 GiB


@pytest.fixture
def plan(monkeypatch, capsys):
    """``vitgraph plan ARGS`` in this process, as a world of its own (an earlier in-process
    run leaves torchrun's variables set); the CUDA_VISIBLE_DEVICES it sets is put back."""
    from vitgraph.cli import main
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", ""))

    def run(*args) -> SimpleNamespace:
        capsys.readouterr()
        code = main(["plan", *map(str, args)])
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)
    return run


def test_plan_says_where_its_gpu_memory_comes_from(plan, monkeypatch):
    """Without a GPU the plan counts against an H200's memory, and says so."""
    import shutil
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no nvidia-smi
    r = plan(ROOT / "configs" / "vit-tiny-shapes.yaml")
    assert "of 139.8 GiB per GPU (no GPU found: an H200 assumed; --gpu-mem sets it; " \
        in r.stdout, r.stdout
    assert " (1 GPU), micro-batch 32 x 1 microbatch a step, " in r.stdout, r.stdout
    r = plan(ROOT / "configs" / "vit-tiny-shapes.yaml", "--gpu-mem", "80", "--json")
    assert json.loads(r.stdout)["gpu_mem_source"] == "--gpu-mem"


def test_cli_says_what_would_fit(plan):
    r = plan(ROOT / "configs" / "vit-6b-imagefolder.yaml", "train.recompute=none",
              "--gpu-mem", "80")
    assert r.returncode == 1, r.stderr
    assert "DOES NOT FIT" in r.stdout
    would = r.stdout.split("would fit: ")[1]
    assert "train.recompute" not in would  # the weights and optimizer alone do not fit 80 GiB
    # 25 heads: tp 5 is the smallest that splits them; 45 layers: pp 3
    assert "parallel.tp=5" in would and "parallel.pp=3" in would and "data-parallel ranks" in would


def test_cli_json_of_a_folder_config_needs_no_folder(plan):
    r = plan(G14, "--gpus", "8", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["layout"]["dp"] == 8 and j["fits"] and j["graphs"] == "step"
    assert j["largest_micro_batch"] > 128 and j["stages"][0]["params"] == j["parameters"]


def test_cli_names_a_bad_layout(plan):
    r = plan(G14, "parallel.tp=3", "--gpus", "8")
    assert r.returncode == 2 and "parallel.tp" in r.stderr
    r = plan(ROOT / "configs" / "vit-tiny-shapes.yaml", "parallel.tp=2", "--gpus", "3")
    assert r.returncode == 2 and r.stderr.endswith(
        "world size 3 (--gpus) is not divisible by it\n"), r.stderr  # the flag, not WORLD_SIZE


def test_cli_refuses_a_gpu_count_or_memory_below_one(plan, capsys):
    """--gpus 0 was taken as the default (1), --gpu-mem -5 planned against; each is a usage
    error naming the flag, exit 2, before anything is counted."""
    for flag, value in (("--gpus", "0"), ("--gpus", "-2"), ("--gpu-mem", "-5"),
                        ("--gpu-mem", "0"), ("--gpus", "two")):
        with pytest.raises(SystemExit) as done:
            plan(ROOT / "configs" / "vit-tiny-shapes.yaml", flag, value)
        err = capsys.readouterr().err
        assert done.value.code == 2 and err.splitlines()[-1].startswith(
            f"vitgraph plan: error: argument {flag}: "), err
        assert value in err.splitlines()[-1]


def test_fsdp_shards_weights_gradients_and_state_over_dp(g14):
    cfg = _cfg(G14, "train.global_batch_size=1024")
    n = sum(q.numel for q in g14.params)
    layer = sum(q.numel for q in g14.params if q.layer == 0)
    one = plan_memory(cfg, g14, Layout(dp=8, distributed_optimizer=False)).stages[0]
    fsdp = plan_memory(cfg, g14, Layout(dp=8, distributed_optimizer=False, fsdp=True)).stages[0]
    # bf16 pieces of the weights and gradients, plus two whole layers gathered and one
    # layer's whole gradient
    assert fsdp.weights == pytest.approx(2 * n / 8 + 2 * 2 * layer, rel=1e-6)
    assert fsdp.grads == pytest.approx(2 * n / 8 + 2 * layer, rel=1e-6)
    assert fsdp.optimizer == pytest.approx(one.optimizer / 8, rel=1e-6)
    assert fsdp.activations == one.activations


def test_cli_offers_fsdp_where_it_fits(plan):
    r = plan(ROOT / "configs" / "vit-6b-imagefolder.yaml", "--gpu-mem", "40")
    assert r.returncode == 1, r.stderr
    would = r.stdout.split("would fit: ")[1]
    assert "parallel.fsdp=true on 4 data-parallel ranks" in would, would


def test_a_caption_model_plans_its_language_model_and_logits():
    """task.kind=caption: the language model's layers and activations (over each image's
    tokens and its text budget) beside the tower's; under pp the tower, projector and
    embedding sit on the first stage, the LM's layers split, its logits on the last."""
    vlm = ROOT / "configs" / "vlm-tiny-shapes.yaml"
    over = ["model.spec=torch", "lm.num_layers=2"]
    model = model_of(vlm, over)
    lm_layers = {q.layer for q in model.params if q.layer is not None}
    assert model.num_layers == 2 and lm_layers == {0, 1}
    image, language = model.stacks
    assert (image.pipelined, language.pipelined) == (False, True)
    assert (image.tokens, language.tokens) == (65, 65 + 32) and model.logit_bytes > 0
    tower = sum(q.numel for q in model.params if q.layer is None and q.first)
    one = plan_memory(_cfg(vlm, *over), model, Layout())
    two = plan_memory(_cfg(vlm, *over, "parallel.pp=2"), model, Layout(pp=2))
    first, last = two.stages
    assert first.params > tower > last.params > 0
    assert first.params + last.params == one.stages[0].params
    # stage 0: the tower and one LM layer; stage 1: one LM layer and the logits
    lm_layer = layer_bytes_per_token(language, 1, False, False) * 32 * language.tokens
    tower_acts = layer_bytes_per_token(image, 1, False, False) * 32 * image.tokens * 4
    assert first.activations > tower_acts + lm_layer > last.activations > lm_layer
    assert one.stages[0].activations > tower_acts + 2 * lm_layer


def test_native_plans_give_the_largest_pack_that_fits():
    """At native resolution a microbatch is one pack: the plan's largest pack (in steps of
    PACK_STEP tokens) fits the budget and the next step does not; the CLI says so."""
    from vitgraph.memory import PACK_STEP, largest_pack, report, with_pack_tokens
    vlm = ROOT / "configs" / "vlm-tiny-shapes-native.yaml"
    over = ["model.spec=torch"]
    cfg, model = _cfg(vlm, *over), model_of(vlm, over)
    image, language = model.stacks
    bigger = with_pack_tokens(model, image.tokens + 1000)
    assert (bigger.stacks[0].tokens, bigger.stacks[1].tokens) == (image.tokens + 1000,
                                                                  language.tokens + 1000)
    budget = 2 * GIB
    best = largest_pack(cfg, model, Layout(), budget)
    assert best > image.tokens and best % PACK_STEP == 0
    peak = [plan_memory(cfg, with_pack_tokens(model, t), Layout(), 1).peak
            for t in (best, best + PACK_STEP)]
    assert peak[0] <= budget < peak[1]
    text, _ = report(vlm, over, 1, 2 + 0.5)
    assert f"largest data.packing.tokens_per_microbatch that fits: {best} " in text


def test_a_native_pair_plans_a_caption_per_image_slot():
    """A CLIP pack's text tower runs on one caption per image slot of the pack."""
    clip = ROOT / "configs" / "clip-tiny-shapes.yaml"
    native = ["model.spec=torch", "data.resolution=native", "data.packing.max_patches=24",
              "data.packing.tokens_per_microbatch=96", "data.packing.max_images=5",
              "train.micro_batch_size=1", "train.global_batch_size=2"]
    fixed, packed = model_of(clip, ["model.spec=torch"]), model_of(clip, native)
    assert fixed.pairs == 1 and packed.pairs > 1  # the resolved pack's image slots
    assert packed.stacks[1].tokens == packed.pairs * fixed.stacks[1].tokens


def test_plan_check_plans_the_native_and_vlm_bench_rows_within_its_tolerance():
    """scripts/plan_check.py's overrides of bench.py's packed SO400M rows (a pack's attention
    in slots at head width 72; with the captioning GPT) give plans within 10% of the peaks
    the committed JSONs measured."""
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    from plan_check import BENCH_BASE, TOLERANCE, bench_rows
    from vitgraph.memory import report
    for path, want in ((ROOT / "benchmarks" / "h200" / "native-so400m16-1024.json", "thd"),
                       (ROOT / "benchmarks" / "h100" / "vlm-so400m16-1024.json", "thd")):
        name, over, measured = next(r for r in bench_rows(path) if f" {want} " in r[0]
                                    and "step-graphs" in r[0])
        assert "data.resolution=native" in over
        assert ("task.kind=caption" in over) == ("vlm" in path.name)
        plan = json.loads(report(BENCH_BASE, over, 1, 139.8, as_json=True)[0])
        error = plan["peak_gib"] / measured["peak_reserved_gib"] - 1
        assert abs(error) <= TOLERANCE, (name, error)
