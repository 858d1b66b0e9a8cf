"""GPU: parallel.fsdp (megatron-core's FSDP2 wrapper around Float16Module, megatron's bf16
optimizer over DTensor pieces) trains the curve of megatron DDP with the same optimizer, and
its checkpoints resume under DDP and the other way; on two GPUs (torchrun, dp=2) the same."""
import pytest
import torch

from test_step_graphs_gpu import TWO_MICROBATCHES, run_steps, two_gpu_run, whole_and_resumed
from test_train_gpu import make_trainer

pytestmark = pytest.mark.gpu

DDP = ["parallel.distributed_optimizer=false", "graphs.enabled=false"]
FSDP = [*DDP, "parallel.fsdp=true"]


def _curve(tmp_path, *over):
    t = make_trainer(tmp_path, *TWO_MICROBATCHES, *over)
    try:
        return run_steps(t, 0, 12)
    finally:
        t.close(shutdown_dist=False)


def _close(got, want, tol):
    """(loss, grad norm) per step: bf16 weights and gradients on both sides, but DDP reduces
    into its fp32 buffer (TE's fused weight-gradient accumulation) and FSDP's gradients are
    bf16, so the curves agree to rounding."""
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=tol, atol=0)


def test_fsdp_trains_the_ddp_curve(tmp_path):
    ddp = _curve(tmp_path / "ddp", *DDP)
    fsdp = _curve(tmp_path / "fsdp", *FSDP)
    assert fsdp[0][0] == pytest.approx(ddp[0][0], rel=1e-3)  # the same weights, one forward
    _close(fsdp, ddp, 2e-2)
    assert fsdp[-1][0] < fsdp[0][0]


@pytest.mark.parametrize("first,then", [(FSDP, DDP), (DDP, FSDP)], ids=["fsdp-ddp", "ddp-fsdp"])
def test_fsdp_checkpoint_resumes_across_ddp(tmp_path, first, then):
    over = [*TWO_MICROBATCHES, "checkpoint.save=true"]
    whole, resumed, _ = whole_and_resumed(tmp_path, [*over, *first], [*over, *then])
    # step 7 runs on the loaded weights: its loss is the uninterrupted run's
    assert resumed[0][0] == pytest.approx(whole[6][0], rel=1e-3)
    _close(resumed, whole[6:], 2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_fsdp_on_two_gpus_trains_the_ddp_curve(tmp_path):
    """torchrun, dp=2: weights, gradients and optimizer state in halves; the curve of DDP."""
    ddp = two_gpu_run(tmp_path / "ddp", *DDP)
    fsdp = two_gpu_run(tmp_path / "fsdp", *FSDP)
    _close([(r["loss"], r["grad_norm"]) for r in fsdp],
           [(r["loss"], r["grad_norm"]) for r in ddp], 2e-2)
