"""GPU: a NaN step in bf16 (megatron's optimizer, TE layers, with and without graphs) is skipped
and leaves weights and optimizer state bit-identical, without a host sync of its own."""
import json
import subprocess

import pytest
import torch

from conftest import ROOT, tiny_overrides, vitgraph_cmd

pytestmark = pytest.mark.gpu


def _tensors(obj):
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


@pytest.mark.parametrize("extra", [[], ["graphs.enabled=true", "graphs.warmup_steps=1"]],
                         ids=["eager", "graphs"])
def test_bf16_nan_steps_are_skipped_on_gpu(tmp_path, env, extra):
    run_dir = tmp_path / "run"
    over = tiny_overrides(run_dir, 8, **{"model.spec": "auto", "train.log_every": 1,
                                         "checkpoint.every": 1, "checkpoint.keep": 20,
                                         "train.inject_nan_steps": "4-5"})
    r = subprocess.run(vitgraph_cmd("train", str(ROOT / "configs" / "vit-tiny-shapes.yaml"),
                                    *over, *extra), env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "bf16" in r.stdout
    log = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    skipped = {x["step"]: x["skipped_steps"] for x in log if "skipped_steps" in x}
    assert [skipped[s] for s in range(1, 9)] == [0, 0, 0, 1, 2, 2, 2, 2]
    ckpt = run_dir / "checkpoints"
    a, b, c = (torch.load(ckpt / f"step_{s:06d}" / "mp_rank_00_000.pt", map_location="cpu",
                          weights_only=False) for s in (3, 5, 6))
    for key in ("model", "optimizer"):
        ta, tb = _tensors(a[key]), _tensors(b[key])
        assert len(ta) == len(tb) > 0
        assert all(torch.equal(x, y) for x, y in zip(ta, tb)), key  # skipped: untouched
    assert not all(torch.equal(x, y) for x, y in zip(_tensors(a["model"]),
                                                     _tensors(c["model"])))
    assert all(torch.isfinite(t.float()).all() for t in _tensors(c["model"])
               if t.is_floating_point())
