"""GPU: optim.offload_fraction (megatron's HybridDeviceOptimizer) trains the curve of the GPU
optimizer within the rounding of its CPU Adam and holds less on the GPU, and its checkpoints
resume the same curve, offloaded or not."""
import gc

import pytest
import torch

import test_train_gpu as train_gpu
from test_train_gpu import batches
from test_step_graphs_gpu import whole_and_resumed

pytestmark = pytest.mark.gpu

BASE = ["model.num_classes=10", "model.num_layers=4", "optim.lr=3e-4", "graphs.enabled=auto",
        "train.global_batch_size=32", "train.micro_batch_size=32", "checkpoint.save=false"]


def _run(path, steps, data, *over):
    """(the loss curve, GiB allocated after the last step: the weights, gradients and what the
    optimizer keeps on the GPU)."""
    gc.collect()  # an earlier test's garbage, freed during this run, would count against it
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    t = train_gpu.make_trainer(path, *BASE, *over)
    try:
        torch.cuda.reset_peak_memory_stats()
        curve = train_gpu.train(t, steps, data)
        torch.cuda.synchronize()
        held = (torch.cuda.memory_allocated() - before) / 2**30
        print(f"{over}: {held:.3f} GiB held, peak {torch.cuda.max_memory_allocated() / 2**30:.3f}")
        return curve, held
    finally:
        t.close(shutdown_dist=False)


def test_offloaded_optimizer_trains_the_curve_and_holds_less(tmp_path):
    data = batches(32)
    want, on_gpu = _run(tmp_path / "gpu", 30, data, "graphs.scope=layer", "graphs.enabled=true")
    got, offloaded = _run(tmp_path / "off", 30, data, "optim.offload_fraction=1.0")
    assert len(got) == 30 and all(map(torch.isfinite, torch.tensor(got)))
    # CPU Adam in fp32 against TE's fused Adam: the same update up to rounding, which bf16
    # weights amplify a little over 30 steps
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2, atol=2e-2)
    assert got[-1] < got[0]
    # the optimizer's fp32 master weights and moments (12 bytes a parameter) leave the GPU
    assert offloaded < on_gpu


@pytest.mark.parametrize("resume_offload", [0.5, 0.0])
def test_offloaded_optimizer_checkpoint_resumes_the_curve(tmp_path, resume_offload):
    """Saved at step 6 with half the optimizer on the CPU (both of megatron's sub-optimizers
    hold state), resumed with the same share or with none: steps 7-12 as without the stop."""
    over = [*BASE, "train.global_batch_size=16", "train.micro_batch_size=8",
            "checkpoint.save=true", "graphs.enabled=false"]
    whole, resumed, _ = whole_and_resumed(tmp_path, [*over, "optim.offload_fraction=0.5"],
                                          [*over, f"optim.offload_fraction={resume_offload}"])
    # step 7 runs on the loaded weights: equal. The same CPU Adam from the same state: then
    # rounding (within 2e-4 over steps 8-12 on an H200); TE's fused Adam for the other half
    tol = 1e-3 if resume_offload == 0.5 else 2e-2
    assert resumed[0] == whole[6]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(whole[6:]), rtol=tol, atol=0)
