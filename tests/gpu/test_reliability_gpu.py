"""GPU: a NaN step in bf16 (megatron's optimizer, TE layers, with and without graphs) is skipped
and leaves weights and optimizer state bit-identical, without a host sync of its own."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, checkpoint_tensors, tiny_overrides

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("extra", [["graphs.enabled=false"], ["graphs.enabled=true", "graphs.warmup_steps=1"]],
                         ids=["eager", "graphs"])
def test_bf16_nan_steps_are_skipped_on_gpu(tmp_path, env, extra):
    run_dir = tmp_path / "run"
    over = tiny_overrides(run_dir, 8, **{"model.spec": "auto", "train.log_every": 1,
                                         "checkpoint.every": 1, "checkpoint.keep": 20})
    # the loss of steps 4 and 5 is NaN (tests/faults.py wraps the task's loss)
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "faults.py"), "4-5", "train",
                        str(ROOT / "configs" / "vit-tiny-shapes.yaml"), *over, *extra],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "bf16" in r.stdout
    log = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    skipped = {x["step"]: x["skipped_steps"] for x in log if "skipped_steps" in x}
    assert [skipped[s] for s in range(1, 9)] == [0, 0, 0, 1, 2, 2, 2, 2]
    ckpt = run_dir / "checkpoints"
    a, b, c = (checkpoint_tensors(ckpt / f"step_{s:06d}") for s in (3, 5, 6))
    model = [k for k in a if not k.startswith("optimizer.")]
    optim = [k for k in a if k.startswith("optimizer.")]
    assert model and optim and a.keys() == b.keys()
    for k in model + optim:  # skipped: weights, fp32 master weights and moments untouched
        assert torch.equal(a[k], b[k]), k
    assert not all(torch.equal(a[k], c[k]) for k in model)
    assert all(torch.isfinite(c[k].float()).all() for k in model)
