"""GPU: layer-wise LR decay through megatron's optimizer param groups (bf16 and distributed
optimizers, the step graphs' sync-free step) and frozen parameters under layer and step graphs:
no main_grad, no optimizer state, unchanged weights."""
import pytest
import torch

import test_train_gpu as train_gpu
from test_layer_decay import expected_layer
from test_train_gpu import batches

pytestmark = pytest.mark.gpu

LAYERS = 2  # test_train_gpu.BASE: model.num_layers=2
FROZEN = ["patch_embed.*", "cls_token", "pos_embed", "decoder.layers.0.*"]


def make_trainer(tmp_path, *over):
    return train_gpu.make_trainer(tmp_path, "model.num_classes=10", *over)


def group_of(optimizer):
    """model parameter -> its param group in megatron's (chained) optimizer."""
    out = {}
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        groups = part.optimizer.param_groups
        if hasattr(part, "model_param_group_index_map"):  # distributed: shards in the groups
            for p, (gi, _) in part.model_param_group_index_map.items():
                out[p] = groups[gi]
        else:
            for gi, g in enumerate(groups):
                for p in part.float16_groups[gi] + part.fp32_from_fp32_groups[gi]:
                    out[p] = g
    return out


@pytest.mark.parametrize("over", [["parallel.distributed_optimizer=false"],
                                  ["parallel.distributed_optimizer=true"],
                                  ["graphs.enabled=true", "graphs.scope=step"]],
                         ids=["bf16-optimizer", "distributed", "step-graphs"])
def test_layer_decay_groups_in_megatrons_optimizer(tmp_path, over):
    decay = 0.65
    t = make_trainer(tmp_path, f"optim.layer_decay={decay}", "optim.warmup_steps=2", *over)
    try:
        from vitgraph.models.freeze import global_names
        names = global_names(t.chunks[0])
        groups = group_of(t.optimizer)
        data = batches()
        for s in range(5):
            t.graphs.step_begin(s)
            t.train_step(data)
        base = t.scheduler.get_lr({})
        o = t.plan.optim
        params = [p for p in t.chunks[0].parameters()]
        assert set(map(id, groups)) == set(map(id, params))
        for p in params:
            s = decay ** (LAYERS + 1 - expected_layer(names[id(p)], LAYERS))
            g = groups[p]
            assert g["max_lr"] == pytest.approx(o.lr * s), names[id(p)]
            assert g["min_lr"] == pytest.approx(o.min_lr * s), names[id(p)]
            assert float(g["lr"]) == pytest.approx(base * s, rel=1e-6), names[id(p)]
        if "graphs.scope=step" in over:  # one device lr per group, filled from its group
            t.optimizer.load_lr()
            lrs = t.optimizer.step.__self__._lrs
            gs = t.optimizer.step.__self__._groups()
            assert len(lrs) == len(gs) >= 2 * (LAYERS + 2)
            assert all(float(x) == pytest.approx(float(g["lr"])) for x, g in zip(lrs, gs))
    finally:
        t.close()


@pytest.mark.parametrize("over", [["graphs.enabled=true", "graphs.scope=layer"],
                                  ["graphs.enabled=true", "graphs.scope=layer",
                                   "graphs.impl=te"],
                                  ["graphs.enabled=true", "graphs.scope=step"]],
                         ids=["layer-local", "layer-te", "step"])
def test_frozen_parameters_under_graphs(tmp_path, over):
    pat = "model.freeze=[" + ", ".join(f'"{x}"' for x in FROZEN) + "]"
    t = make_trainer(tmp_path, pat, "graphs.warmup_steps=2", "optim.layer_decay=0.75",
                     "optim.lr=1e-3", "optim.warmup_steps=1", *over)
    try:
        from vitgraph.models.freeze import global_names
        names = global_names(t.chunks[0])
        frozen = [p for p in t.chunks[0].parameters() if not p.requires_grad]
        # patch_embed weight and bias, cls_token, pos_embed; layer 0's 12 TE tensors
        assert len(frozen) == 4 + 12 and all(
            names[id(p)].startswith(("patch_embed.", "decoder.layers.0.")) or
            names[id(p)] in ("cls_token", "pos_embed") for p in frozen)
        assert all(getattr(p, "main_grad", None) is None for p in frozen)  # no grad buffer
        groups = group_of(t.optimizer)
        assert not any(p in groups for p in frozen)  # no optimizer state
        before = {id(p): p.detach().clone() for p in t.chunks[0].parameters()}
        data, losses = batches(), []
        for s in range(8):  # eager warm-up, capture, replays
            t.graphs.step_begin(s)
            r = t.train_step(data)
            losses.append((r.stats[0] / r.stats[2]).item())
        torch.cuda.synchronize()
        assert all(torch.isfinite(torch.tensor(losses))), losses
        for p in frozen:
            assert torch.equal(p.detach(), before[id(p)]), names[id(p)]
        moved = {names[id(p)] for p in t.chunks[0].parameters()
                 if not torch.equal(p.detach(), before[id(p)])}
        assert {"head.weight", "decoder.layers.1.mlp.linear_fc1.weight"} <= moved, moved
        if "graphs.scope=layer" in over:
            assert t.graphs.stats()["replays"] > 0
    finally:
        t.close()
