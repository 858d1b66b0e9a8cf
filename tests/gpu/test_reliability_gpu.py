"""GPU: a NaN step in bf16 (megatron's optimizer, TE layers, with and without graphs) is skipped
and leaves weights and optimizer state bit-identical, without a host sync of its own; a
step-graph run (fixed and native resolution) preempted three times ends on the uninterrupted
run's curve."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, checkpoint_tensors, tiny_overrides
from faults import sigterm_at

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


def _log_steps(run_dir) -> dict:
    log = run_dir / "log.jsonl"
    if not log.is_file():
        return {}
    recs = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


@pytest.mark.parametrize("config", ["vit-tiny-shapes.yaml", "vit-tiny-shapes-native.yaml"],
                         ids=["fixed", "native"])
def test_three_preemptions_end_on_the_uninterrupted_curve(tmp_path, capsys, config):
    """Step graphs (TE, bf16), SIGTERMed at three random steps and resumed each time: every
    stop exits 75 after its step's checkpoint, and the stitched curve is the uninterrupted
    run's, within bf16 noise (TE's fused attention backward may accumulate in any order:
    not asserted bit-equal)."""
    import random
    from vitgraph.cli import main
    steps = 24
    extra = {"model.spec": "auto", "train.log_every": 1, "checkpoint.every": 0,
             "graphs.enabled": "true", "graphs.scope": "step", "graphs.warmup_steps": 2}
    cfg = str(ROOT / "configs" / config)
    assert main(["train", cfg, *tiny_overrides(tmp_path / "ref", steps, **extra)]) == 0
    run = tmp_path / "run"
    for stop in sorted(random.Random(config).sample(range(3, steps - 2), 3)):
        # the signal sent by this process itself as step ``stop`` starts (tests/faults.py);
        # in this process, as the reference: a launch per stop costs ~30 s of imports
        with sigterm_at(stop):
            assert main(["train", cfg, *tiny_overrides(run, steps, **extra)]) == 75
        assert max(_log_steps(run)) == stop  # finished its step, then stopped
    capsys.readouterr()
    assert main(["train", cfg, *tiny_overrides(run, steps, **extra)]) == 0
    assert "at step" in capsys.readouterr().out  # resumed
    want, got = _log_steps(tmp_path / "ref"), _log_steps(run)
    assert sorted(got) == list(range(1, steps + 1))
    assert [got[s] for s in want] == pytest.approx([want[s] for s in want], rel=2e-2)
