"""task.kind=caption at native resolution on CPU: the tower on an image pack and the language
model on its thd pack (each sample's image tokens, then its text; cu_seqlens per sample)
give the fixed composition's logits per sample; greedy captions of a pack, layer graphs ==
eager, and a short run with its held-out eval through `vitgraph train` / `vitgraph eval`."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, assert_graphed_step_equals_eager, tiny_overrides, world_of_one
from vitgraph.cli import main
from vitgraph.config import load_config
from vitgraph.data.packing import assemble
from vitgraph.models.build import transformer_config
from vitgraph.models.caption import TextPackSpec, build_caption, text_layout
from vitgraph.plan import resolve
from vitgraph.tasks.caption import IGNORE, CaptionTask, text_targets
from vitgraph.text import make_tokenizer

VLM = ROOT / "configs" / "vlm-tiny-shapes-native.yaml"
# small image packs: up to 4 images of <= 64 patches in 256 tokens
NATIVE = ["data.packing.tokens_per_microbatch=256", "data.packing.max_images=4"]
CAPTIONS = ["star, large white", "l-shape, small dark blue", "circle"]
GRIDS = [(8, 8), (4, 10), (6, 6)]  # 65, 41 and 37 tokens with the class token

dist1 = world_of_one("torch")


def fixed_logits(model, image, tokens):
    """The fixed composition's text logits [b, L, vocab] over image tokens [n, b, h]."""
    hidden = model.language_model.decoder(hidden_states=model.lm_input(image, tokens),
                                          attention_mask=None)
    n = image.shape[0]  # this image's tokens (text_logits takes the fixed tower's count)
    return model._logits(hidden[n:n + tokens.shape[1]]).transpose(0, 1)


def setup(d, *over, grids=GRIDS, captions=CAPTIONS, seed=0):
    plan = resolve(load_config(VLM, ["model.spec=torch", *NATIVE, *over]), 1)
    task = CaptionTask(plan, d)
    lm = plan.caption
    task.tokenizer = make_tokenizer(lm.tokenizer, lm.vocab_size, lm.text_length)
    model = build_caption(plan.arch, transformer_config(plan, plan.model, d), "torch", lm,
                          lm.vocab_size, seed=0, pack=plan.pack, pos_interp=plan.pos_interp)
    gen = torch.Generator().manual_seed(seed)
    spec = plan.pack
    rows = [torch.randint(0, 256, (h * w, spec.patch_dim), generator=gen, dtype=torch.uint8)
            for h, w in grids]
    labels = [4, 7, 0][:len(grids)]
    fields = assemble(rows, grids, labels, spec)
    tokens = torch.zeros(spec.max_images, lm.text_length, dtype=torch.long)
    tokens[:len(captions)] = task.tokenizer(captions)
    inputs = task.prepare((*fields, tokens), None, "cpu", True)
    return task, model, inputs


def test_text_layout_places_each_sample_then_padding():
    """Two samples of 3 and 2 image tokens and texts of 3 and 2 ids (EOS 9), a third slot
    empty: positions from 0 in each sample, one segment each, padding after."""
    spec = TextPackSpec(tokens=16, samples=3, text_length=4, max_len=7)
    seg = torch.tensor([0, 0, 0, 1, 1, 3, 3, 3])  # slot 2 empty, 3 = padding
    tokens = torch.tensor([[7, 1, 9, 0], [7, 9, 0, 0], [0, 0, 0, 0]])
    src, pos, cu, rows = text_layout(seg, tokens, 9, spec)
    zero = 8 + 3 * 4
    assert src.tolist() == [0, 1, 2, 8, 9, 10, 3, 4, 12, 13] + [zero] * 6
    assert pos.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3] + [0] * 6
    assert cu.tolist() == [0, 6, 10, 10, 16, 16, 16]  # 3 samples + ceil(16 / 7) padding
    assert rows[0, :3].tolist() == [3, 4, 5] and rows[1, :2].tolist() == [8, 9]
    assert (rows[0, 3:] == 15).all() and (rows[2] == 15).all()


def test_packed_logits_are_each_samples_fixed_composition(dist1):
    """Per sample, the packed text logits up to its EOS are the fixed path's (which
    test_caption.py checks against GPTModel.forward) on that image's tokens alone; the loss
    counts the captions' tokens of the slots holding an image, and its gradients are those of
    the fixed composition's loss over the same samples."""
    task, model, inputs = setup(dist1)
    model.eval()
    spec = model.text_pack
    assert spec.max_len == 65 + 32 and model.language_model.embedding.position_embeddings \
        .weight.shape[0] == spec.max_len
    logits = task.forward(model, inputs)
    tokens, labels = inputs[4], inputs[5]
    assert logits.shape == (4, 32, 264) and labels.tolist() == [4, 7, 0, task.fill_label]
    image = model.packed_image_tokens(inputs[:4])
    cu = inputs[3].tolist()
    for i in range(len(GRIDS)):
        n = len(task.tokenizer.encode(CAPTIONS[i]))
        own = image[cu[i]:cu[i + 1]][:, None]  # [n_img, 1, h]
        want = fixed_logits(model, own, tokens[i:i + 1, :n])[0]
        torch.testing.assert_close(logits[i, :n], want, rtol=1e-5, atol=1e-5)
    loss, stats = task.loss(inputs, logits)
    assert stats[2].item() == sum(len(task.tokenizer.encode(c)) - 1 for c in CAPTIONS)
    model.train()
    task.loss(inputs, task.forward(model, inputs))[0].backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    image = model.packed_image_tokens(inputs[:4])
    total, count = 0.0, 0
    for i in range(len(GRIDS)):
        targets = text_targets(tokens[i:i + 1], task.tokenizer.eot_id)[0]
        own = fixed_logits(model, image[cu[i]:cu[i + 1]][:, None], tokens[i:i + 1])[0]
        total = total + F.cross_entropy(own[:-1], targets, ignore_index=IGNORE, reduction="sum")
        count += int((targets != IGNORE).sum())
    (total / count).backward()
    for name, p in model.named_parameters():
        assert packed[name].abs().sum() > 0, name
        torch.testing.assert_close(packed[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_padded_image_slots_give_the_same_logits(dist1):
    """data.packing.layout=padded (each image in a slot of its own, a key mask): the same
    text logits as the packed layout."""
    task, model, inputs = setup(dist1)
    ptask, pmodel, pinputs = setup(dist1, "data.packing.layout=padded")
    assert pmodel.visual.packed_attention == "padded"
    model.eval(), pmodel.eval()
    a, b = task.forward(model, inputs), ptask.forward(pmodel, pinputs)
    keep = text_targets(inputs[4], task.tokenizer.eot_id) != IGNORE
    torch.testing.assert_close(a[:3, :-1][keep[:3]], b[:3, :-1][keep[:3]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("whole_packs", [False, True], ids=["kv-cache", "whole-pack"])
def test_greedy_captions_of_a_pack_are_the_argmax_after_each_prefix(dist1, whole_packs):
    """Greedy captions of a pack (the tower packed, then the KV cache per image token count,
    or the language model's whole pack for each token) are, per slot, the argmax of the
    packed forward's logits after the ids before it; an empty slot's row is padding."""
    task, model, inputs = setup(dist1, "lm.num_layers=2", grids=[(8, 8), (4, 10), (5, 8)])
    tok = task.tokenizer
    ids = model.generate_packs([tuple(inputs[:4])], tok.sot_id, tok.eot_id, 12, tok.pad_id,
                               whole_packs=whole_packs)[0]
    assert model.training and ids.shape == (4, 12)
    assert (ids[:3, 0] == tok.sot_id).all() and (ids[3] == tok.pad_id).all()
    want_ids = torch.zeros(4, 32, dtype=torch.long)
    want_ids[:, :12] = ids
    layout = text_layout(inputs[2], want_ids, tok.eot_id, model.text_pack)
    model.eval()
    with torch.no_grad():
        want = model(tuple(inputs[:4]), want_ids, layout).argmax(-1)[:3, :11]
    keep = text_targets(ids[:3], tok.eot_id) != IGNORE  # up to and with EOS
    assert torch.equal(ids[:3, 1:][keep], want[keep])
    assert keep.sum() > 3 * 4  # the comparison covers decode steps
    # the eval calls it without megatron's Float16Module: a pack's fp32 patches, bf16 model
    assert inputs[0].dtype == torch.float32
    ids = model.to(torch.bfloat16).generate(tuple(inputs[:4]), tok.sot_id, tok.eot_id, 4,
                                            tok.pad_id)
    assert ids.shape == (4, 4) and (ids[:3, 0] == tok.sot_id).all()


def test_an_image_in_a_pack_costs_the_fixed_compositions_flops(dist1):
    """Task.pack_flops (per token, token pair, image) of an image of the fixed size's token
    count: the fixed composition's FLOPs per sample (tower, LM over image + text budget,
    output layer)."""
    native, fixed = (CaptionTask(resolve(load_config(VLM, ["model.spec=torch", *over]), 1),
                                 dist1) for over in ([], ["data.resolution=fixed"]))
    for task in (native, fixed):
        task.build_model(with_init_from=False)
    per_token, pair, per_image = native.pack_flops
    n = 65  # 8 x 8 patches and the class token
    assert fixed.flops_per_sample > 0
    assert n * per_token + n * n * pair + per_image == pytest.approx(fixed.flops_per_sample)


def test_a_pack_with_its_host_fields_appended_prepares_as_without(dist1):
    """The prefetcher appends the task's host fields (the language model's layout, made from
    the pack's CPU fields in its thread): prepare takes them instead of making its own."""
    task, _, _ = setup(dist1)
    plan = task.plan
    fields = assemble([torch.zeros(h * w, plan.pack.patch_dim, dtype=torch.uint8)
                       for h, w in GRIDS], GRIDS, [4, 7, 0], plan.pack)
    tokens = torch.zeros(plan.pack.max_images, plan.caption.text_length, dtype=torch.long)
    tokens[:3] = task.tokenizer(CAPTIONS)
    raw = (*fields, tokens)
    extra = task.host_fields(raw)
    assert len(extra) == 4  # src, positions, cu_seqlens, text rows
    want = task.prepare(raw, None, "cpu", True)
    src, pos, cu, rows = extra
    got = task.prepare((*raw, src, pos + 1, cu, rows), None, "cpu", True)  # marked: taken
    assert len(got) == len(want) == 10
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b + 1 if i == 7 else b), i
    fixed = CaptionTask(resolve(load_config(VLM, ["model.spec=torch", "data.resolution=fixed"]),
                                1), dist1)
    assert fixed.host_fields(raw) == ()


def test_layer_graphs_give_the_eager_loss_and_gradients_at_native_resolution(dist1):
    """The tower's and the language model's layers graphed (the CPU rerun backend) on packs:
    eager's loss and gradients exactly, at capture and at replay (another pack)."""
    from vitgraph.graphs import GraphManager, RerunBackend
    task, eager, _ = setup(dist1)
    _, graphed, _ = setup(dist1)
    mgr = GraphManager.for_model([graphed], {"enabled": True, "warmup_steps": 0},
                                 backend=RerunBackend())
    assert len(mgr.layers) == 4 + 1
    for step, grids in enumerate([GRIDS, [(3, 12), (8, 8)]]):
        inputs = setup(dist1, grids=grids, captions=CAPTIONS[:len(grids)], seed=step)[2]
        mgr.step_begin(step)
        assert_graphed_step_equals_eager(
            eager, graphed, lambda model: task.loss(inputs, task.forward(model, inputs))[0])
    assert mgr.stats()["replays"] > 0


# the CLI runs below tear down the process groups of dist1: they come last
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("vlm-native") / "run"
    over = [*tiny_overrides(run, steps=12, **{"train.eval_every": 12, "train.log_every": 4,
                                              "data.num_train": 256, "data.num_val": 60}),
            *NATIVE]
    return main(["train", str(VLM), *over]), run, over


def test_a_native_caption_run_trains_and_its_eval_is_vitgraph_evals(trained):
    code, run, over = trained
    assert code == 0, (run / "train.log").read_text()[-3000:]
    records = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    losses = {x["step"]: x["loss"] for x in records if "loss" in x}
    assert losses[12] < losses[4] < math.log(259) + 0.5, losses
    log = (run / "train.log").read_text()
    assert "language-model packs of" in log and "greedy captions:" in log
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["eval_images"] == 60
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_caption_loss"]))
    assert main(["eval", str(VLM), *over]) == 0
    written = json.loads((run / "eval-12.json").read_text())
    for key in ("eval_caption_loss", "eval_perplexity", "eval_class_word_accuracy"):
        assert written[key] == pytest.approx(metrics[key], rel=1e-5), key
