"""GPU: the Trainer's real path (TE spec, Float16Module, megatron DDP + optimizer) on one GPU:
gradient-buffer alignment, FP8 with and without graphs, token padding under TE attention."""
import math

import pytest
import torch

from vitgraph.config import ConfigError, load_config

from conftest import ROOT

pytestmark = pytest.mark.gpu

BASE = ["data.kind=shapes", "data.num_train=64", "data.num_val=64", "data.render_size=32",
        "model.num_layers=2", "train.global_batch_size=8", "train.micro_batch_size=8",
        "train.steps=1000", "train.tensorboard=false", "train.progress=false",
        "train.log_every=1000", "train.eval_batch_size=8",
        "graphs.enabled=false"]  # eager unless a test asks for graphs (auto: step graphs)


def make_trainer(tmp_path, *over):
    from vitgraph.train.loop import Trainer
    cfg = load_config(ROOT / "configs" / "vit-b16-imagefolder.yaml",
                      [*BASE, f"run.dir={tmp_path}", *over])
    return Trainer(cfg)


def batches(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (n, 224, 224, 3), dtype=torch.uint8, generator=g),
             torch.randint(0, 10, (n,), generator=g))]


def train(trainer, steps, data=None):
    data = data or batches()
    out = []
    for s in range(steps):
        trainer.graphs.step_begin(s)
        r = trainer.train_step(data)
        out.append((r.stats[0] / r.stats[2]).item())
    return out


@pytest.mark.parametrize("over", [["model.num_classes=10"], ["model.num_classes=37"],
                                  ["model.num_classes=1000"],
                                  ["model.num_classes=10", "model.num_registers=4"],
                                  ["model.num_classes=10", "model.class_token=false",
                                   "model.pool=mean"]],
                         ids=["10", "37", "1000", "registers", "no-class-token"])
def test_every_main_grad_is_256_byte_aligned(tmp_path, over):
    from vitgraph.parallel.setup import misaligned
    t = make_trainer(tmp_path, *over)
    try:
        assert misaligned(t.wrapped) == []
        params = [p for w in t.wrapped for p in w.parameters()]
        assert all(p.main_grad.data_ptr() % 256 == 0 for p in params)
        # bf16 parameter storage: megatron's distributed-optimizer buffer starts each one on
        # a 64-element (128-byte) boundary; cuBLAS needs 16
        assert all(p.data_ptr() % 128 == 0 for p in params)
    finally:
        t.close(shutdown_dist=False)


def test_without_distributed_optimizer_misalignment_is_reported(tmp_path, caplog):
    t = make_trainer(tmp_path, "parallel.distributed_optimizer=false", "model.num_classes=10")
    try:
        from vitgraph.parallel.setup import misaligned
        assert misaligned(t.wrapped)  # 10 fp32 head-bias elements shift everything after them
    finally:
        t.close(shutdown_dist=False)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_fp8_trains_with_padded_tokens(tmp_path, recipe, graphs):
    """197 tokens x micro-batch 8 is not a multiple of 16: padded to 198 and masked."""
    over = ["train.precision=fp8", f"train.fp8_recipe={recipe}"]
    if graphs:
        over += ["graphs.enabled=true", "graphs.impl=te", "graphs.warmup_steps=2"]
    t = make_trainer(tmp_path, *over)
    try:
        assert t.model.padded_len(8) == 198
        losses = train(t, 8)
        assert all(math.isfinite(x) for x in losses), losses
        assert losses[-1] < losses[1], losses  # it fits the fixed batch
        if graphs:
            assert t.graphs.stats()["replays"] > 0
    finally:
        t.close(shutdown_dist=False)


def test_fp8_graphs_equal_fp8_eager(tmp_path):
    curves = []
    for graphs in (False, True):
        over = ["train.precision=fp8", "train.fp8_recipe=current"]
        if graphs:
            over += ["graphs.enabled=true", "graphs.impl=te", "graphs.warmup_steps=2"]
        t = make_trainer(tmp_path / str(graphs), *over)
        try:
            curves.append(train(t, 8))
        finally:
            t.close(shutdown_dist=False)
    assert curves[1] == pytest.approx(curves[0], rel=2e-2), curves


def test_mxfp8_on_hopper_is_a_config_error(tmp_path):
    if torch.cuda.get_device_capability()[0] >= 10:
        pytest.skip("this GPU has MXFP8")
    with pytest.raises(ConfigError, match="mxfp8"):
        make_trainer(tmp_path, "train.precision=fp8", "train.fp8_recipe=mxfp8")


def test_padded_tokens_do_not_change_the_model(tmp_path):
    """TE attention with the padding mask: a padded model computes what the unpadded one does."""
    t = make_trainer(tmp_path, "model.num_classes=10")
    try:
        model = t.model
        with torch.no_grad():
            torch.nn.init.normal_(model.head.weight, std=0.02)
        x = torch.randn(8, 3, 224, 224, device="cuda")
        plain = t.wrapped[0](x)
        # a model with the padding-mask layer spec, same weights
        from vitgraph.models.specs import get_layer_spec
        from vitgraph.models.vit import ViT
        padded = ViT(model.config, get_layer_spec("te", padding_mask=True), model.arch, 10,
                     pad_to=lambda b: 16).cuda().to(torch.bfloat16)
        padded.load_state_dict(model.state_dict(), strict=False)
        assert padded.padded_len(8) == 208
        out = padded(x.to(torch.bfloat16))
        rel = ((out.float() - plain.float()).norm() / plain.float().norm()).item()
        assert rel < 2e-2, rel
    finally:
        t.close(shutdown_dist=False)


@pytest.mark.parametrize("dist_opt", ["true", "false"])
def test_bf16_weights_copied_from_fp32_in_one_multi_tensor_call(tmp_path, dist_opt):
    """megatron's optimizers copy fp32 weights to the model through vitgraph's multi-tensor
    copy: after steps, every bf16 weight is its fp32 master rounded."""
    t = make_trainer(tmp_path, "train.precision=bf16", f"parallel.distributed_optimizer={dist_opt}")
    try:
        train(t, 3)
        parts = getattr(t.optimizer, "chained_optimizers", None) or [t.optimizer]
        checked = 0
        for part in parts:
            assert "_copy_main_params_to_model_params" in vars(part)
            for main_group, model_group in zip(
                    getattr(part, "shard_fp32_from_float16_groups", None) or part.fp32_from_float16_groups,
                    getattr(part, "model_float16_groups", None) or part.float16_groups):
                for main, param in zip(main_group, model_group):
                    if main.numel() == param.numel():  # a whole parameter on this rank (dp 1)
                        assert torch.equal(param.detach(), main.detach().view_as(param).to(param.dtype))
                        checked += 1
        assert checked >= 30  # two layers of twelve, embedding, norm and head
    finally:
        t.close(shutdown_dist=False)
