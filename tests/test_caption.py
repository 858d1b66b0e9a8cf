"""task.kind=caption on CPU: the tower -> MultimodalProjector -> GPTModel composition, its
text-only loss, greedy generation, a short training run and its held-out eval."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, tiny_overrides, world_of_one
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
    n_img = model.image_len
    assert n_img == 65 and logits.shape == (3, tokens.shape[1], task.tokenizer.vocab_size)
    full = model.language_model(input_ids=None, position_ids=None, attention_mask=None,
                                decoder_input=model.embed(model.image_tokens(images), tokens))
    assert full.shape[1] == n_img + tokens.shape[1]
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
    fill = torch.tensor([4, -1, 0])  # a sample that only fills an eval microbatch up
    assert task.loss((images, tokens, fill), logits)[1][2].item() == lengths[0] + lengths[2]
    loss.backward()
    for part in (model.visual, model.projector, model.language_model):
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in part.parameters())


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


@pytest.mark.parametrize("overrides,key,why", [
    (["parallel.tp=2"], "parallel.tp", "tp=1, pp=1"),
    (["model.name=clip_tiny_patch4_32"], "model.name", "not an image-text pair"),
    (["lm.num_heads=3"], "lm.num_heads", "not divisible"),
    (["lm.freeze_tower=true", "lm.freeze_lm=true"], "lm.freeze_lm", "only the projector"),
    (["lm.tokenizer=words"], "lm.tokenizer", "bpe, byte"),
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
        losses = []
        for model in (eager, graphed):
            model.zero_grad()
            loss, _ = task.loss((images, tokens, labels), model(images, tokens))
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
        for (name, a), b in zip(eager.named_parameters(), graphed.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)
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

