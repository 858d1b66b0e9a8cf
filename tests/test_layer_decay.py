"""Layer-wise LR decay (optim.layer_decay, the BEiT rule): every parameter's group anneals between
lr x decay^(L + 1 - i) and min_lr x the same, i its layer (0 the embeddings, L + 1 the head), in
one process and under pipeline stages (torchrun, gloo), where the index is the global one."""
import json
import re
from pathlib import Path

import pytest

from conftest import ROOT, launch_output, tiny_overrides

DEFAULT = str(ROOT / "configs" / "vit-tiny-shapes.yaml")
CLIP = str(ROOT / "configs" / "clip-tiny-shapes.yaml")
DECAY = 0.6
LAYERS = 4  # vit_pico_patch4_32
EMBEDDINGS = {"cls_token", "pos_embed", "patch_embed.weight", "patch_embed.bias"}


def expected_layer(name: str, depth: int = LAYERS) -> int:
    """The BEiT index of a classifier parameter, from its global name."""
    m = re.match(r"(?:\w+\.)?decoder\.layers\.(\d+)\.", name)
    if m:
        return int(m.group(1)) + 1
    tail = name.split(".", 1)[1] if name.startswith(("visual.", "text.")) else name
    if tail in EMBEDDINGS or tail.startswith(("ln_pre.", "token_embed.")) or tail == "pos_embed":
        return 0
    return depth + 1


def group_rows(trainer) -> list[tuple]:
    """(global name, lr, max_lr, min_lr, wd_mult) of every trainable parameter."""
    from vitgraph.models.freeze import global_names
    names = {}
    for c in trainer.chunks:
        names.update(global_names(c))
    return [(names[id(p)], g["lr"], g["max_lr"], g["min_lr"], g["wd_mult"])
            for g in trainer.optimizer.param_groups for p in g["params"]]


def check_rows(rows, base_lr, lr, min_lr, depth=LAYERS):
    assert rows
    for name, got, max_lr, low, _ in rows:
        s = DECAY ** (depth + 1 - expected_layer(name, depth))
        assert max_lr == pytest.approx(lr * s), name
        assert low == pytest.approx(min_lr * s), name
        assert got == pytest.approx(base_lr * s, rel=1e-9), (name, got, base_lr, s)


def make_trainer(tmp_path, config=DEFAULT, *extra):
    from vitgraph.config import load_config
    from vitgraph.train.loop import Trainer
    cfg = load_config(config, tiny_overrides(tmp_path / "run", steps=20) + [
        f"optim.layer_decay={DECAY}", "optim.warmup_steps=4", *extra])
    return Trainer(cfg)


def test_groups_follow_the_beit_rule_through_the_schedule(tmp_path):
    t = make_trainer(tmp_path)
    try:
        o = t.plan.optim
        groups = t.optimizer.param_groups
        # one group per (weight decay on / off, layer): 2 x (L + 2), no parameter left out
        assert len(groups) == 2 * (LAYERS + 2)
        n = sum(1 for c in t.chunks for p in c.parameters())
        assert sum(len(g["params"]) for g in groups) == n
        assert all(g["default_config"] == (g["lr_scale"] == 1.0) for g in groups)
        for step in (0, 2, 4, 11, 20):  # warm-up, its end, cosine, the last step
            t.scheduler.num_steps = 0
            t.scheduler.step(step)
            base = t.scheduler.get_lr({})
            check_rows(group_rows(t), base, o.lr, o.min_lr)
        # the embeddings train at lr x decay^(L + 1), the head at lr
        scale = {name: max_lr / o.lr for name, _, max_lr, _, _ in group_rows(t)}
        assert scale["pos_embed"] == pytest.approx(DECAY ** 5)
        assert scale["decoder.layers.0.mlp.linear_fc1.weight"] == pytest.approx(DECAY ** 4)
        assert scale["decoder.layers.3.mlp.linear_fc1.weight"] == pytest.approx(DECAY)
        assert scale["head.weight"] == scale["final_norm.weight"] == 1.0
    finally:
        t.close()


def test_the_logged_lr_is_the_heads(tmp_path):
    """Group 0 is a decayed one; the log shows the base lr (the head's)."""
    t = make_trainer(tmp_path, DEFAULT, "train.log_every=5")
    try:
        assert t.optimizer.param_groups[0]["lr_scale"] < 1.0
        t.run()
        log = [json.loads(x) for x in (t.run_dir / "log.jsonl").read_text().splitlines()]
        rec = [r for r in log if "lr" in r and r["step"] == 10][0]
        t.scheduler.num_steps = 0
        t.scheduler.step(10)
        assert rec["lr"] == pytest.approx(t.scheduler.get_lr({}))
        assert rec["lr"] == pytest.approx(max(g["lr"] for g in t.optimizer.param_groups))
    finally:
        t.close()


def test_each_tower_of_a_pair_decays_over_its_own_depth(tmp_path):
    t = make_trainer(tmp_path, CLIP, "data.num_train=256", "data.num_val=100",
                     "task.context_length=32")
    try:
        o = t.plan.optim
        model = t.chunks[0]
        depth = {"visual": model.visual.decoder.config.num_layers,
                 "text": model.text.decoder.config.num_layers}
        rows = group_rows(t)
        for tower, L in depth.items():
            check_rows([r for r in rows if r[0].startswith(tower + ".")],
                       t.scheduler.get_lr({}), o.lr, o.min_lr, L)
        logit = [r for r in rows if r[0] == "logit_scale"][0]
        assert logit[2] == pytest.approx(o.lr)  # outside both towers: the head's lr
    finally:
        t.close()


def pipeline_groups(out: str, overrides: list[str]) -> None:
    """A call job of the session's launch of two (conftest.launched): this rank's groups and
    rows, saved and read back by a resumed Trainer, into out/rank<r>.json."""
    from vitgraph.config import load_config
    from vitgraph.train.loop import Trainer
    t = Trainer(load_config(DEFAULT, overrides))
    t.scheduler.step(7)
    result = {"rank": t.d.rank, "pp_rank": t.d.pp_rank, "base": t.scheduler.get_lr({}),
              "groups": [(g["max_lr"], g["wd_mult"]) for g in t.optimizer.param_groups],
              "rows": group_rows(t), "lr": t.plan.optim.lr, "min_lr": t.plan.optim.min_lr}
    t.checkpointer.save(t.step)  # fills the frozen layer's slice of the stacked optimizer state
    t.close(shutdown_dist=False)
    t = Trainer(load_config(DEFAULT, overrides))
    t.maybe_resume()  # same groups on every rank: the checkpoint's common param groups fit
    result["resumed"] = [t.scheduler.get_lr({}), group_rows(t)]
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{t.d.rank}.json").write_text(json.dumps(result))
    t.close()


def launch_jobs(root) -> dict[int, list]:
    overrides = [*tiny_overrides(root / "run", steps=20), f"optim.layer_decay={DECAY}",
                 "optim.warmup_steps=4", "parallel.pp=2", "parallel.vpp=2",
                 "train.global_batch_size=32", "train.micro_batch_size=8",
                 'model.freeze=["decoder.layers.3.*"]']
    return {2: [("pp2-vpp2", {"call": "test_layer_decay:pipeline_groups",
                              "kwargs": {"out": str(root / "ranks"), "overrides": overrides}})]}


@pytest.mark.multiproc
def test_pipeline_stages_use_the_global_layer_index(launched):
    """pp=2 x vpp=2 on 4 layers: rank 0 holds layers 0 and 2, rank 1 layers 1 and 3, each
    chunk naming its one layer decoder.layers.0. The groups follow the global index, every
    rank makes the same groups, and the frozen global layer 3 (rank 1's second chunk) is in
    none; a checkpoint saved so resumes."""
    out, launch = launched[__name__]["pp2-vpp2"]
    for i in range(2):
        if not (out / f"rank{i}.json").is_file():
            pytest.fail(f"rank {i} wrote nothing{launch_output(launch)}")
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]
    assert ranks[0]["groups"] == ranks[1]["groups"]  # aligned: a checkpoint's common state
    layers = []
    for rk in ranks:
        check_rows(rk["rows"], rk["base"], rk["lr"], rk["min_lr"])
        layers.append({expected_layer(n) for n, *_ in rk["rows"]})
    assert layers[0] == {0, 1, 3}  # embeddings, global layers 0 and 2
    assert layers[1] == {2, LAYERS + 1}  # global layer 1 (layer 3 frozen), the head
    names = [n for rk in ranks for n, *_ in rk["rows"]]
    assert len(names) == len(set(names))
    assert not [n for n in names if n.startswith("decoder.layers.3.")]
    assert "decoder.layers.2.mlp.linear_fc2.weight" in {n for n, *_ in ranks[0]["rows"]}
    for rk in ranks:  # a checkpoint of this layout resumes with its schedule and groups
        assert rk["resumed"] == [rk["base"], rk["rows"]]
