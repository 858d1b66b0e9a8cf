"""CLIP towers split over two tensor-parallel ranks (gloo, CPU) compute what one rank does:
the same features, loss and gradients, from the same seed."""
import pytest
import torch

from conftest import ROOT, assert_results, write_result


def _gather_tp(p: torch.Tensor, grad: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist
    if not getattr(p, "tensor_model_parallel", False):
        return grad
    parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, grad.contiguous(), group=group)
    return torch.cat(parts, dim=p.partition_dim)


def _run(tp: int, name: str):
    from megatron.core import parallel_state as ps
    from vitgraph.config import load_config
    from vitgraph.models.clip import build_clip
    from vitgraph.models.build import transformer_config
    from vitgraph.parallel.setup import init_distributed, launched_world_size
    from vitgraph.plan import resolve
    from vitgraph.tasks.contrastive_loss import clip_loss, siglip_loss
    from vitgraph.text.tokenizer import ByteTokenizer
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml",
                      ["model.spec=torch", f"parallel.tp={tp}", "train.global_batch_size=64"])
    plan = resolve(cfg, launched_world_size())
    d = init_distributed(plan)
    model = build_clip(name, transformer_config(plan, cfg.model, d), "torch", seed=5,
                       tp_rank=d.tp_rank, tp_size=d.tp)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(4, 3, 32, 32, generator=g)
    toks = ByteTokenizer(128)(["a red star", "a blue circle on the left", "x", "a big square"])
    out = model(images, toks)
    # negatives from the data-parallel group only (of one rank at tp=2). At tp=1 the two
    # processes are dp=2 with the same batch: each scores its own batch alone there too
    import torch.distributed as dist
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    group = ps.get_data_parallel_group() if tp > 1 else singles[dist.get_rank()]
    loss = (clip_loss(*out[:3], group=group) if len(out) == 3
            else siglip_loss(*out, group=group))
    loss.backward()
    group = ps.get_tensor_model_parallel_group()
    grads = {n: _gather_tp(p, p.grad, group) for n, p in model.named_parameters()}
    return out[0].detach(), out[1].detach(), loss.detach(), grads


def _compare(name):
    from megatron.core import parallel_state as ps
    img2, txt2, loss2, grads2 = _run(2, name)
    ps.destroy_model_parallel()  # the same two processes again, now tp=1 (dp=2)
    img1, txt1, loss1, grads1 = _run(1, name)
    torch.testing.assert_close(img2, img1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(txt2, txt1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss2, loss1, rtol=1e-5, atol=1e-6)
    split = [n for n in grads1 if grads1[n].shape != dict(_shapes(grads2))[n]]
    assert not split, split
    for n in grads1:
        # fp32 sums in another order over two ranks: one text.pos_embed element of 8192
        # differed by 1.5e-6 once the patch embedding became a GEMM
        torch.testing.assert_close(grads2[n], grads1[n], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{n}: {m}")


def compare_pairs(out: str, names: list[str]) -> None:
    """A call job of the session's launch of two (conftest.launched): each pair in turn in
    the same two processes, a result per pair and rank."""
    import torch.distributed as dist
    for name in names:
        write_result(out, f"{name}-{dist.get_rank()}", _compare, name)


def _shapes(grads):
    return [(n, g.shape) for n, g in grads.items()]


NAMES = ["clip_tiny_patch4_32", "siglip_tiny_patch4_32"]


def launch_jobs(root) -> dict[int, list]:
    return {2: [("tp2", {"call": "test_clip_parallel:compare_pairs",
                         "kwargs": {"out": str(root / "tp2"), "names": NAMES}})]}


@pytest.mark.multiproc
@pytest.mark.parametrize("name", NAMES)
def test_tp2_equals_tp1(launched, name):
    assert_results(*launched[__name__]["tp2"], [f"{name}-0", f"{name}-1"])
