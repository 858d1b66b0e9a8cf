"""task.kind=caption on CPU: the tower -> MultimodalProjector -> GPTModel composition, its
text-only loss, greedy generation, a short training run and its held-out eval."""
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, assert_graphed_step_equals_eager, tiny_overrides, world_of_one
from vitgraph.cli import main
from vitgraph.config import load_config
from vitgraph.models.caption import build_caption
from vitgraph.models.build import transformer_config
from vitgraph.models.freeze import freeze
from vitgraph.plan import resolve
from vitgraph.tasks.caption import IGNORE, CaptionTask, first_class, text_targets
from vitgraph.text import make_tokenizer

VLM = ROOT / "configs" / "vlm-tiny-shapes.yaml"
FAST = ["data.num_train=512", "data.num_val=100", "train.eval_batch_size=50"]
CAPTIONS = ["a large white star", "a small dark blue l-shape", "a circle"]

dist1 = world_of_one("torch")


def plan_of(*over):
    return resolve(load_config(VLM, ["model.spec=torch", *over]), 1)


def task_and_model(d, *over):
    plan = plan_of(*over)
    task = CaptionTask(plan, d)
    lm = plan.caption
    task.tokenizer = make_tokenizer(lm.tokenizer, lm.vocab_size, lm.text_length)
    model = build_caption(plan.arch, transformer_config(plan, plan.model, d), "torch", lm,
                          lm.vocab_size, seed=0)
    return task, model


def test_targets_cover_the_caption_and_its_eos_only():
    tokens = torch.tensor([[7, 1, 2, 9, 0, 0], [7, 3, 9, 0, 0, 0]])  # 7 BOS, 9 EOS, 0 pad
    assert text_targets(tokens, eos=9).tolist() == [[1, 2, 9, IGNORE, IGNORE],
                                                    [3, 9, IGNORE, IGNORE, IGNORE]]


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_logits_are_gptmodels_at_the_text_and_the_loss_counts_text_only(dist1, tokenizer):
    """The text logits are GPTModel.forward's on [image tokens, text] at the text positions;
    the loss is the mean cross-entropy over each caption's next tokens and its EOS: the count
    is the captions' tokens, whatever the image length, and padding changes nothing."""
    task, model = task_and_model(dist1, f"lm.tokenizer={tokenizer}")
    model.eval()
    tokens = task.tokenizer(CAPTIONS)
    images, labels = torch.randn(3, 3, 32, 32), torch.tensor([4, 7, 0])
    logits = model(images, tokens)
    n_img, vocab = model.image_len, task.tokenizer.vocab_size
    # the vocabulary padded to a multiple of 8 (byte ids: 259 -> 264), the padding at -inf
    assert n_img == 65 and logits.shape == (3, tokens.shape[1], -(-vocab // 8) * 8)
    assert (logits[..., vocab:] == float("-inf")).all()
    logits = logits[..., :vocab]
    full = model.language_model(input_ids=None, position_ids=None, attention_mask=None,
                                decoder_input=model.embed(model.image_tokens(images), tokens))
    assert full.shape[1] == n_img + tokens.shape[1]
    full = full[..., :vocab]
    torch.testing.assert_close(logits, full[:, n_img:], rtol=1e-5, atol=1e-5)
    loss, stats = task.loss((images, tokens, labels), logits)
    lengths = [len(task.tokenizer.encode(c)) - 1 for c in CAPTIONS]  # BOS predicts nothing
    assert stats[2].item() == sum(lengths)
    want = sum(F.cross_entropy(full[i, n_img:n_img + k], tokens[i, 1:k + 1], reduction="sum")
               for i, k in enumerate(lengths)) / sum(lengths)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    padded = tokens.clone()
    padded[tokens == task.tokenizer.pad_id] = 100  # the padding after EOS, another id
    torch.testing.assert_close(task.loss((images, padded, labels), model(images, padded))[0],
                               loss, rtol=1e-5, atol=1e-5)
    fill = torch.tensor([4, task.fill_label, -1])  # a filler sample; an unlabelled pair trains
    assert task.loss((images, tokens, fill), logits)[1][2].item() == lengths[0] + lengths[2]
    loss.backward()
    for part in (model.visual, model.projector, model.language_model):
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in part.parameters())


def test_the_model_line_counts_in_words(dist1):
    """vlm-tiny-shapes' language model has one layer: 'GPT (1 layer', not '1 layers'."""
    from vitgraph.output import plural
    task, model = task_and_model(dist1)
    assert "-> GPT (1 layer, width 64, 4 heads, " in task.describe([model], 1)
    assert [plural(n, w) for n, w in ((1, "GPU"), (8, "GPU"), (2, "microbatch"),
                                     (0, "layer"))] == ["1 GPU", "8 GPUs", "2 microbatches",
                                                        "0 layers"]


def test_greedy_generation_gives_ids_that_decode(dist1):
    task, model = task_and_model(dist1)
    tok = task.tokenizer
    ids = model.generate(torch.randn(4, 3, 32, 32), tok.sot_id, tok.eot_id, 10, tok.pad_id)
    assert ids.shape == (4, 10) and ids.dtype == torch.long
    assert (ids[:, 0] == tok.sot_id).all() and ((ids >= 0) & (ids < tok.vocab_size)).all()
    for row in ids.tolist():
        if tok.eot_id in row:  # nothing but padding after the end of text
            assert all(i == tok.pad_id for i in row[row.index(tok.eot_id) + 1:])
        assert isinstance(tok.decode(row), str)
    # each token is the argmax of the logits after the ids before it (the loop's short
    # prefixes give the full sequence's logits: the mask is causal)
    images = torch.randn(2, 3, 32, 32)
    ids = model.generate(images, tok.sot_id, tok.eot_id, 6, tok.pad_id)
    with torch.no_grad():
        want = model(images, ids).argmax(-1)[:, :-1]
    keep = text_targets(ids, tok.eot_id, IGNORE) != IGNORE  # up to and with EOS
    assert torch.equal(ids[:, 1:][keep], want[keep])
    # the eval calls it without megatron's Float16Module (which casts a training step's
    # inputs): fp32 images into a bf16 model
    ids = model.to(torch.bfloat16).generate(images, tok.sot_id, tok.eot_id, 6, tok.pad_id)
    assert ids.shape == (2, 6) and (ids[:, 0] == tok.sot_id).all()


def test_kv_cache_greedy_gives_the_no_cache_tokens(dist1):
    """Greedy captions through megatron's KV cache (the image and BOS, then one position per
    token) are the tokens of the loop without a cache, which runs the image and the whole
    text so far again for each token; the model's mode is left as it was."""
    task, model = task_and_model(dist1, "lm.num_layers=2")
    tok, length = task.tokenizer, 12
    images = torch.randn(3, 3, 32, 32)
    model.train()
    ids = model.generate(images, tok.sot_id, tok.eot_id, length, tok.pad_id)
    assert model.training
    model.eval()
    want = torch.full_like(ids, tok.pad_id)
    want[:, 0] = tok.sot_id
    with torch.no_grad():
        for i in range(1, length):
            want[:, i] = model(images, want[:, :i])[:, -1].argmax(-1)
    ended = (want == tok.eot_id).long().cumsum(1)
    want[(ended - (want == tok.eot_id).long()) > 0] = tok.pad_id  # padding after EOS
    assert torch.equal(ids, want)
    assert (ids[:, 1:] != tok.pad_id).sum() > 3 * 4  # the comparison covers decode steps


def test_class_word_is_the_first_shape_named():
    import re
    pats = [re.compile(rf"(?<!\w){re.escape(c)}(?!\w)") for c in ("circle", "star", "l - shape")]
    assert first_class("a large white star", pats) == 1
    assert first_class("a star near a circle", pats) == 1
    assert first_class("a small l - shape", pats) == 2
    assert first_class("a starfish", pats) == -1


def test_freezing_the_tower_or_the_language_model(dist1):
    _, model = task_and_model(dist1)
    plan = plan_of("lm.freeze_tower=true")
    assert plan.freeze == (("lm.freeze_tower", "visual.*"),)
    freeze([model], plan.freeze)
    frozen = {n.split(".")[0] for n, p in model.named_parameters() if not p.requires_grad}
    trained = {n.split(".")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert frozen == {"visual"} and trained == {"projector", "language_model"}
    assert plan_of("lm.freeze_lm=true").freeze == (("lm.freeze_lm", "language_model.*"),)


def test_tower_weights_from_a_file_are_named_by_it(dist1, tmp_path, caplog):
    """A caption run's model.init_from of a tower's weights names the file in its log line and
    errors (the tower reads the file's tensors already loaded, not the path)."""
    import logging

    from safetensors.torch import save_file

    from vitgraph.convert import ConvertError
    from vitgraph.convert.vlm import init_caption
    _, model = task_and_model(dist1)
    sd = {k: v.detach().clone() for k, v in model.visual.state_dict().items()
          if not k.endswith("_extra_state")}
    good = tmp_path / "tower.safetensors"
    save_file(sd, str(good))
    with caplog.at_level(logging.INFO, logger="vitgraph"):
        init_caption(model, str(good), "vitgraph", "byte")
    assert f"init: weights from {good} (vitgraph)" in caplog.text
    sd["patch_embed.weight"] = sd["patch_embed.weight"][:, :, :2, :2].contiguous()
    bad = tmp_path / "bad.safetensors"
    save_file(sd, str(bad))
    with pytest.raises(ConvertError, match=re.escape(str(bad))):
        init_caption(model, str(bad), "vitgraph", "byte")


def test_the_tower_trains_at_its_lr_scale(dist1):
    """lm.tower_lr_scale: the tower's param groups anneal between optim.lr / min_lr x the
    scale, the projector's and the language model's at optim.lr; AdamW's first step moves the
    tower's weights by the scale times what it moves them at scale 1, the rest by the same."""
    from vitgraph.train.optim import CpuOptimizer, build_scheduler, lr_scales, optim_line
    task, _ = task_and_model(dist1)
    tokens, labels = task.tokenizer(CAPTIONS), torch.tensor([4, 7, 0])
    images = torch.randn(3, 3, 32, 32)
    moved = {}
    for scale in (1.0, 0.25):
        plan = plan_of(f"lm.tower_lr_scale={scale}", "optim.warmup_steps=0")
        _, model = task_and_model(dist1)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = CpuOptimizer([model], plan.optim, plan.lr_rules)
        sched = build_scheduler(opt, plan.optim, 10)
        sched.step(1)
        tower = {id(p) for p in model.visual.parameters()}
        for g in opt.param_groups:
            for p in g["params"]:
                want = scale if id(p) in tower else 1.0
                assert g["max_lr"] == pytest.approx(plan.optim.lr * want)
                assert g["min_lr"] == pytest.approx(plan.optim.min_lr * want)
            assert g["lr"] == pytest.approx(sched.get_lr(g))
        loss, _ = task.loss((images, tokens, labels), model(images, tokens))
        loss.backward()
        opt.step()
        moved[scale] = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    for name, full in moved[1.0].items():
        want = 0.25 * full if name.startswith("visual.") else full
        # (weights near 1 keep a step to float32 rounding)
        torch.testing.assert_close(moved[0.25][name], want, rtol=1e-3, atol=1e-6, msg=name)
    assert any(d.abs().sum() > 0 for n, d in moved[0.25].items() if n.startswith("visual."))
    plan = plan_of("lm.tower_lr_scale=0.25")
    _, model = task_and_model(dist1)
    assert "lm.tower_lr_scale 0.25 (visual.* at lr x 0.25)" in optim_line(
        plan.optim, lr_scales([model], None, plan.lr_rules), plan.lr_rules)


@pytest.mark.parametrize("overrides,key,why", [
    (["parallel.pp=2", "parallel.vpp=2"], "parallel.vpp", "whole on the first"),
    (["parallel.pp=2"], "parallel.pp", "lm.num_layers=1 is not divisible"),
    (["parallel.tp=4", "lm.num_heads=2"], "parallel.tp", "lm.num_heads=2 is not divisible"),
    (["parallel.tp=2", "lm.projector=affine"], "lm.projector", "tp-split bias"),
    (["parallel.tp=2", "data.resolution=native", "train.micro_batch_size=1"],
     "data.resolution", "under parallel.tp / pp takes fixed-size"),
    (["model.name=clip_tiny_patch4_32"], "model.name", "not an image-text pair"),
    (["lm.num_heads=3"], "lm.num_heads", "not divisible"),
    (["lm.freeze_tower=true", "lm.freeze_lm=true"], "lm.freeze_lm", "only the projector"),
    (["lm.tokenizer=words"], "lm.tokenizer", "bpe, byte"),
    (["lm.tower_lr_scale=-0.1"], "lm.tower_lr_scale", ">= 0"),
    (["lm.freeze_tower=true", "lm.tower_lr_scale=0.1"], "lm.tower_lr_scale", "no lr to scale"),
    (["data.captions=long"], "data.captions", "short, shape_first"),
])
def test_caption_config_errors_exit_2(capsys, overrides, key, why):
    assert main(["train", str(VLM), *overrides]) == 2
    err = capsys.readouterr().err
    assert key in err and why in err, err


def test_layer_graphs_of_both_models_give_the_eager_loss_and_gradients(dist1):
    """The tower's and the language model's layers graphed (the CPU rerun backend: the
    bookkeeping of capture and replay) give eager's loss and gradients, at capture and at
    replay."""
    from vitgraph.graphs import GraphManager, RerunBackend
    task, eager = task_and_model(dist1)
    _, graphed = task_and_model(dist1)  # the same seed: the same weights
    for a, b in zip(eager.parameters(), graphed.parameters()):
        assert torch.equal(a, b)
    mgr = GraphManager.for_model([graphed], {"enabled": True, "warmup_steps": 0},
                                 backend=RerunBackend())
    assert len(mgr.layers) == 4 + 1  # the tower's and the GPT's TransformerLayers
    tokens = task.tokenizer(CAPTIONS)
    labels = torch.tensor([4, 7, 0])
    for step in range(2):
        images = torch.randn(3, 3, 32, 32)
        mgr.step_begin(step)
        assert_graphed_step_equals_eager(
            eager, graphed,
            lambda model: task.loss((images, tokens, labels), model(images, tokens))[0])
    assert mgr.stats()["replays"] > 0


# the CLI runs below tear down the process groups of dist1: they come last
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short training run of the tiny config (shared by the tests below)."""
    run = tmp_path_factory.mktemp("vlm") / "run"
    code = main(["train", str(VLM), *tiny_overrides(run, steps=20, **{
        "train.eval_every": 20, "train.log_every": 5}), *FAST])
    return code, run


def test_short_training_lowers_the_caption_loss(trained):
    code, run = trained
    assert code == 0, (run / "train.log").read_text()[-3000:]
    records = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    losses = {x["step"]: x["loss"] for x in records if "loss" in x}
    assert losses[20] < losses[5] < math.log(259) + 0.5, losses
    assert "greedy captions:" in (run / "train.log").read_text()


def test_eval_writes_caption_loss_perplexity_and_class_word_accuracy(trained, capsys):
    code, run = trained
    assert code == 0
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["eval_images"] == 100
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_caption_loss"]))
    assert 0 <= metrics["eval_class_word_accuracy"] <= 1
    hits = metrics["eval_class_word_accuracy"] * 100
    assert hits == pytest.approx(round(hits), abs=1e-6)
    assert main(["eval", str(VLM), *tiny_overrides(run), *FAST]) == 0
    written = json.loads((run / "eval-20.json").read_text())
    for key in ("eval_caption_loss", "eval_perplexity", "eval_class_word_accuracy"):
        assert written[key] == pytest.approx(metrics[key], rel=1e-5), key
    assert written["eval_class_word_chance"] == metrics["eval_class_word_chance"] == 0.1


def test_eval_of_another_vocabulary_is_refused_and_a_run_directory_is_a_config(trained, capsys):
    """vitgraph eval with a config whose model does not fit the checkpoint (CLIP's BPE
    vocabulary for a byte-level run) exits 2 naming the tensor and both shapes, instead of
    loading what fits and scoring garbage; the run's directory stands for its config."""
    code, run = trained
    assert code == 0
    capsys.readouterr()
    assert main(["eval", str(run), "lm.tokenizer=bpe"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint error" in err and "word_embeddings.weight" in err and "49408" in err, err
    # the checkpoint named, and both shapes: the checkpoint's and this config's
    assert str(run / "checkpoints" / "step_000020") in err, err
    assert re.search(r"word_embeddings\.weight is \[\d+, \d+\] there, \[49408, \d+\] here", err), err
    assert main(["eval", str(run)]) == 0
    assert (run / "eval-20.json").is_file()


def test_the_whole_vlm_exports_and_a_run_starts_from_it(trained, tmp_path, capsys):
    """export --format vitgraph of a caption run: every tensor of the tower, the projector
    and the language model, with config.json naming the geometry and the tokenizer;
    model.init_from of that file gives a caption run (another seed) the trained model's
    logits, bit for bit (the reference loads the checkpoint's tensors by torch's
    load_state_dict); a run of another geometry is refused, naming the tensor."""
    from vitgraph.convert import ConvertError, read_checkpoint_weights
    from vitgraph.convert.checkpoints import checkpoint_dir
    from vitgraph.parallel.setup import init_distributed, shutdown
    code, run = trained
    assert code == 0
    out = tmp_path / "vlm" / "model.safetensors"
    assert main(["export", str(run), "--format", "vitgraph", "--out", str(out)]) == 0
    config = json.loads((out.parent / "config.json").read_text())
    assert config["tokenizer"] == "byte" and config["text_length"] == 32
    assert config["model"]["name"] == "vit_pico_patch4_32" and config["image_tokens"] == 65
    assert config["language_model"] == {"num_layers": 1, "hidden_size": 64, "num_heads": 4,
                                        "ffn_hidden_size": 256, "vocab_size": 264,
                                        "positions": 97}
    assert main(["export", str(run), "--format", "timm", "--out", str(tmp_path / "t.st")]) == 2
    assert "vitgraph (the whole model) or hf" in capsys.readouterr().err
    plan = plan_of(f"model.init_from={out}", "train.seed=1")
    d = init_distributed(plan)
    try:
        task = CaptionTask(plan, d)
        loaded = task.build_model()[0].eval()
        fresh = task.build_model(with_init_from=False)[0].eval()
        ref = CaptionTask(plan_of(), d).build_model()[0].eval()
        sd, _ = read_checkpoint_weights(checkpoint_dir(run))
        missing, unexpected = ref.load_state_dict(sd, strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing)
        images = torch.randn(4, 3, 32, 32)
        tokens = make_tokenizer("byte", 259, 32)(CAPTIONS + ["a star"])
        with torch.no_grad():
            got = loaded(images, tokens)
            assert torch.equal(got, ref(images, tokens))
            assert not torch.allclose(got, fresh(images, tokens))
        other = CaptionTask(plan_of(f"model.init_from={out}", "lm.text_length=16"), d)
        with pytest.raises(ConvertError, match="position_embeddings.*lm"):
            other.build_model()
    finally:
        shutdown()



def test_training_from_image_text_shards_with_a_transformers_tokenizer(tmp_path, capsys):
    """task.kind=caption from WebDataset shards (jpg + txt: scripts/make_shards.py
    --captions, the class name as caption; the training pairs without their cls, as
    image-text data comes) with lm.tokenizer=hf:<folder> (a tokenizer saved in tmp): the
    captions are the shards' texts, the vocabulary the tokenizer's, unlabelled pairs train,
    and the eval JSON has the caption loss, perplexity, class-word accuracy and its chance."""
    from conftest import write_hf_tokenizer
    from test_data import _make_shards, _shapes_folder
    src = _shapes_folder(tmp_path / "folder", n_train=24, n_val=8, classes=3, size=32)
    shards = _make_shards(src, tmp_path / "shards", "--shard-size", "8", "--captions")
    index = json.loads((shards / "index.json").read_text())
    for shard in index["splits"]["train"]:
        for sample in shard["samples"]:
            del sample["cls"]
    (shards / "index.json").write_text(json.dumps(index))
    classes = sorted(p.name for p in (src / "train").iterdir())
    tok = write_hf_tokenizer(tmp_path / "tok", classes, bos_token="<s>", eos_token="</s>",
                             pad_token="<pad>")
    run = tmp_path / "run"
    over = tiny_overrides(run, steps=4, **{
        "data.kind": "webdataset", "data.path": str(shards),
        "data.captions": "full", "lm.tokenizer": f"hf:{tok}",
        "lm.text_length": 8, "train.global_batch_size": 8, "train.micro_batch_size": 8,
        "train.eval_batch_size": 8, "train.eval_every": 4})
    assert main(["train", str(VLM), *over]) == 0, capsys.readouterr().err[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["step"] == 4 and metrics["eval_images"] == 8
    records = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert all(x["loss"] > 0 for x in records if "loss" in x)  # the text tokens counted
    assert metrics["eval_class_word_chance"] == pytest.approx(1 / 3)
    assert 0 <= metrics["eval_class_word_accuracy"] <= 1
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_caption_loss"]))
    log = (run / "train.log").read_text()
    vocab = make_tokenizer(f"hf:{tok}", 0, 8).vocab_size
    assert f"{vocab} hf:{tok} ids" in log
