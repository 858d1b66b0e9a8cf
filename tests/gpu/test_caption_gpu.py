"""GPU: task.kind=caption through `vitgraph train` with TE layers in bf16 (the tower,
megatron-core's projector and GPTModel), at fixed and native resolution: layer graphs and step
graphs train the eager run's curve, the loss falls, and the eval (caption loss, greedy
captions through megatron-core's KV cache on TE attention) writes its metrics; a native pack
from the prefetcher is prepared without a host read."""
import json
import math
import re

import pytest
import torch

from conftest import ROOT, loss_records, tiny_overrides

pytestmark = pytest.mark.gpu

STEPS = 30
GRAPHS = {"eager": {"graphs.enabled": "false"},
          "layer": {"graphs.enabled": "true", "graphs.scope": "layer", "graphs.warmup_steps": 2},
          "step": {"graphs.enabled": "true", "graphs.scope": "step", "graphs.warmup_steps": 2}}


@pytest.mark.parametrize("config", ["vlm-tiny-shapes.yaml", "vlm-tiny-shapes-native.yaml"],
                         ids=["fixed", "native"])
def test_caption_graphs_train_the_eager_curve_and_eval_on_the_gpu(tmp_path, capsys, config):
    from vitgraph.cli import main
    from vitgraph.models.specs import te_available
    if not te_available():
        pytest.skip("Transformer Engine is not installed")
    curves = {}
    for name, graphs in GRAPHS.items():
        run = tmp_path / name
        over = tiny_overrides(run, STEPS, **{
            "model.spec": "auto", "train.log_every": 1, "checkpoint.every": 0,
            "train.eval_every": STEPS if name == "step" else 0, "data.num_val": 100,
            "train.eval_batch_size": 50, **graphs})
        code = main(["train", str(ROOT / "configs" / config), *over])
        log = (run / "train.log").read_text()
        assert code == 0, log[-4000:]
        assert "spec te," in log and ", bf16" in log, log[:3000]
        if name != "eager":  # replayed, and no call ran eagerly after the warm-up steps
            counts = {int(m[0]): (int(m[1]), int(m[2])) for m in re.findall(
                r"step (\d+)/\d+ .*replays (\d+), eager calls (\d+)", log)}
            assert counts[STEPS][0] > counts[5][0] > 0, counts
            assert counts[STEPS][1] == counts[5][1], counts
        curves[name] = {r["step"]: r["loss"] for r in loss_records(run)}
    capsys.readouterr()
    want = curves["eager"]
    assert sorted(want) == list(range(1, STEPS + 1))
    assert want[STEPS] < want[1] - 0.5, want  # byte-level ids: ln 259 = 5.56 at the start
    for name in ("layer", "step"):  # TE's attention backward may sum in any order: bf16 noise
        got = curves[name]
        assert [got[s] for s in want] == pytest.approx([want[s] for s in want], rel=2e-2), name
    metrics = json.loads((tmp_path / "step" / "metrics.json").read_text())
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_caption_loss"]),
                                                       rel=1e-4)
    assert 0 <= metrics["eval_class_word_accuracy"] <= 1
    assert "greedy captions:" in (tmp_path / "step" / "train.log").read_text()


def test_a_native_caption_pack_is_prepared_without_a_host_read(tmp_path):
    """The prefetcher stages a pack with its language model's layout appended (made from its
    CPU fields in the prefetcher's thread), so preparing it reads nothing back from the
    device: CUDA's sync debug mode raises on any synchronizing call."""
    from vitgraph.config import load_config
    from vitgraph.models.specs import te_available
    from vitgraph.train.loop import Trainer
    if not te_available():
        pytest.skip("Transformer Engine is not installed")
    cfg = load_config(ROOT / "configs" / "vlm-tiny-shapes-native.yaml", tiny_overrides(
        tmp_path, 4, **{"model.spec": "auto", "graphs.enabled": "false"}))
    t = Trainer(cfg)
    try:
        pack = t.loader.next_step()[0]
        assert len(pack) == 6 + 4 and all(f.is_cuda for f in pack)  # fields + the layout
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            inputs = t._prepare(pack, (0, 0))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert len(inputs) == 10 and all(x.is_cuda for x in inputs)
    finally:
        t.close(shutdown_dist=False)
