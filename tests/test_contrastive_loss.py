"""CLIP and SigLIP losses: against direct full-batch formulas in one process, and over dp=2
and dp=4 (gloo, the session's launch of four) against one process on the full batch, loss and
gradients."""
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_results, write_result
from vitgraph.tasks.contrastive_loss import clip_loss, siglip_loss


def reference_clip(img, txt, scale):
    """Written out element by element: -log softmax of the matching pair, both directions."""
    logits = scale * img @ txt.T
    n = logits.shape[0]
    i2t = -torch.stack([logits[i].log_softmax(0)[i] for i in range(n)]).mean()
    t2i = -torch.stack([logits[:, j].log_softmax(0)[j] for j in range(n)]).mean()
    return (i2t + t2i) / 2


def reference_siglip(img, txt, scale, bias):
    n = img.shape[0]
    total = 0.0
    for i in range(n):
        for j in range(n):
            z = scale * img[i] @ txt[j] + bias
            total = total - (F.logsigmoid(z) if i == j else F.logsigmoid(-z))
    return total / n


def features(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (F.normalize(torch.randn(n, 6, generator=g), dim=-1),
            F.normalize(torch.randn(n, 6, generator=g), dim=-1))


def test_clip_loss_one_process():
    img, txt = features()
    scale = torch.tensor(14.0)
    want = reference_clip(img, txt, scale).item()
    assert clip_loss(img, txt, scale).item() == pytest.approx(want, rel=1e-6)
    # aligned pairs with a large scale: the loss vanishes; shuffled pairs: it does not
    assert clip_loss(img, img, torch.tensor(100.0)).item() < 1e-3
    assert clip_loss(img, img.roll(1, 0), torch.tensor(100.0)).item() > 1.0


def test_siglip_loss_one_process():
    img, txt = features()
    scale, bias = torch.tensor(10.0), torch.tensor(-10.0)
    got = siglip_loss(img, txt, scale, bias).item()
    assert got == pytest.approx(reference_siglip(img, txt, scale, bias).item(), rel=1e-6)
    # orthonormal features: matching pairs at logit +5, the rest at -5 -> a small loss; the
    # pairs shifted by one -> every positive at -5, one negative at +5 -> a large one
    eye = torch.eye(6)
    assert siglip_loss(eye, eye, scale, torch.tensor(-5.0)).item() < 0.05
    assert siglip_loss(eye, eye.roll(1, 0), scale, torch.tensor(-5.0)).item() > 9.0


def _check(rank, world, group):
    """One data-parallel rank of ``world`` (``rank`` within ``group``): loss and gradients
    equal the full-batch ones."""
    import torch.distributed as dist
    torch.manual_seed(0)  # the same data and weights on every rank
    n, b = 8, 8 // world
    x_img, x_txt = torch.randn(n, 5), torch.randn(n, 7)

    def make():
        torch.manual_seed(1)
        return (torch.nn.Linear(5, 4), torch.nn.Linear(7, 4),
                torch.nn.Parameter(torch.tensor(2.5)), torch.nn.Parameter(torch.tensor(-3.0)))

    for kind in ("clip", "siglip", "siglip-all-gather"):
        # one process, the full batch: the reference, written without the library's gather
        wi, wt, s, bias = make()
        img, txt = F.normalize(wi(x_img), dim=-1), F.normalize(wt(x_txt), dim=-1)
        ref = (reference_clip(img, txt, s.exp()) if kind == "clip"
               else reference_siglip(img, txt, s.exp(), bias))
        ref.backward()
        ref_grads = [p.grad.clone() for p in (*wi.parameters(), *wt.parameters(), s, bias)
                     if p.grad is not None]

        # this rank's slice, negatives from the other ranks
        wi, wt, s, bias = make()
        sl = slice(rank * b, (rank + 1) * b)
        img, txt = F.normalize(wi(x_img[sl]), dim=-1), F.normalize(wt(x_txt[sl]), dim=-1)
        if kind == "clip":
            loss = clip_loss(img, txt, s.exp(), group=group)
        else:
            exchange = "all_gather" if kind == "siglip-all-gather" else "ring"
            loss = siglip_loss(img, txt, s.exp(), bias, group=group, exchange=exchange)
        loss.backward()
        params = [p for p in (*wi.parameters(), *wt.parameters(), s, bias) if p.grad is not None]
        assert len(params) == len(ref_grads), kind
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=group)
        mean_loss /= world
        assert mean_loss.item() == pytest.approx(ref.item(), rel=1e-5), (kind, rank)
        # (the local loss alone is not the reference: the test can tell them apart)
        assert loss.item() != pytest.approx(ref.item(), rel=1e-3)
        for p, want in zip(params, ref_grads):
            g = p.grad.clone()
            dist.all_reduce(g, group=group)  # data-parallel mean of the gradients, as DDP
            g /= world
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


def check_dp(out: str) -> None:
    """A call job of the session's launch of four (conftest.launched): dp=4 over all of
    them, then dp=2 in two groups of two (ranks 0-1 and 2-3, each its own data-parallel
    world, as with tp=2)."""
    import torch.distributed as dist
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for world, group, r in ((4, dist.group.WORLD, rank), (2, pairs[rank // 2], rank % 2)):
        write_result(out, f"dp{world}-rank{rank}", _check, r, world, group)


def launch_jobs(root) -> dict[int, list]:
    return {4: [("dp", {"call": "test_contrastive_loss:check_dp",
                        "kwargs": {"out": str(root / "dp")}})]}


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_dp_matches_one_process_on_the_full_batch(launched, world):
    """dp=2, and dp=4 (the ring then has more than one hop)."""
    assert_results(*launched[__name__]["dp"], [f"dp{world}-rank{r}" for r in range(4)])
