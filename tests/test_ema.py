"""train.ema: the EMA of the weights against a hand-computed average, skipped steps, exact
resume, a checkpoint without one, evaluation of both weights, export --ema, and the dp shards'
gather (torchrun, gloo)."""
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import yaml

from conftest import ROOT, assert_results, checkpoint_tensors, tiny_overrides, write_result
from faults import nan_loss_at
from vitgraph.cli import main

DEFAULT = str(ROOT / "configs" / "vit-tiny-shapes.yaml")
EMA = {"train.ema.decay": 0.9}
STEP_GRAPHS = ["graphs.enabled=true", "graphs.scope=step", "graphs.warmup_steps=1"]


def trainer(run_dir, *extra, steps=5, **over):
    from vitgraph.config import load_config
    from vitgraph.train.loop import Trainer
    return Trainer(load_config(DEFAULT, [*tiny_overrides(run_dir, steps, **over), *extra]))


def weights(t) -> dict:
    return {n: p.detach().clone().float() for n, p in t.model.named_parameters()}


def one_step(t) -> None:
    """What Trainer.run does for one step."""
    t.graphs.step_begin(t.step)
    t.train_step(t.loader.next_step(), None)
    t.step += 1


def hand_update(avg: dict, w: dict, decay: float) -> dict:
    return {k: avg[k] + (1 - decay) * (w[k] - avg[k]) for k in avg}


def assert_close(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7, msg=k)


@pytest.mark.parametrize("warmup", [True, False], ids=["warmup", "no-warmup"])
@pytest.mark.parametrize("extra", [[], STEP_GRAPHS], ids=["eager", "step-graphs"])
def test_ema_equals_the_hand_computed_average_over_5_steps(tmp_path, warmup, extra):
    t = trainer(tmp_path / "run", *extra, **EMA, **{"train.ema.warmup": str(warmup).lower()})
    try:
        avg = weights(t)
        assert_close(t.ema.named(t.chunks), avg)  # starts at the weights
        for n in range(5):
            one_step(t)
            w = weights(t)
            decay = min(0.9, (1 + n) / (10 + n)) if warmup else 0.9
            avg = hand_update(avg, w, decay)
            got = t.ema.named(t.chunks)
            assert_close(got, avg)
            assert any(not torch.equal(got[k], w[k]) for k in w)  # an average, not the weights
        assert float(t.ema.count) == 5
        if extra:
            assert t.graphs.stats()["replays"] > 0
    finally:
        t.close()


def test_a_skipped_step_leaves_the_ema_and_its_count(tmp_path):
    t = trainer(tmp_path / "run", **EMA)
    try:
        with nan_loss_at("3"):
            one_step(t), one_step(t)
            before, w2 = t.ema.named(t.chunks), weights(t)
            one_step(t)  # NaN loss: skipped
            assert_close(weights(t), w2)
            after = t.ema.named(t.chunks)
            assert all(torch.equal(before[k], after[k]) for k in before)
            assert float(t.ema.count) == 2
            one_step(t)  # the third update: n = 2
            assert_close(t.ema.named(t.chunks), hand_update(after, weights(t), 3 / 12))
    finally:
        t.close()


def test_the_device_flag_is_folded_into_the_update():
    """A captured step's ``ok`` is a device tensor: 0 leaves the EMA and n, 1 updates."""
    from vitgraph.train.ema import WeightEMA
    p = torch.nn.Parameter(torch.zeros(3, 2))
    ema = WeightEMA(SimpleNamespace(param_groups=[{"params": [p]}]),
                    SimpleNamespace(decay=0.5, warmup=False), "cpu")
    with torch.no_grad():
        p.fill_(2.0)
    ema.update(torch.tensor(False))
    assert torch.equal(ema.full()[0], torch.zeros(3, 2)) and float(ema.count) == 0
    ema.update(False)
    assert float(ema.count) == 0
    ema.update(torch.tensor(True))
    assert torch.equal(ema.full()[0], torch.ones(3, 2)) and float(ema.count) == 1
    with ema.swapped():
        assert torch.equal(p, torch.ones(3, 2))
    assert torch.equal(p, torch.full((3, 2), 2.0))


# ---------------------------------------------------------------- runs: resume, eval, export

@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    """10 steps with EMA evaluated at 5 and 10, saved at 5 and 10."""
    run_dir = tmp_path_factory.mktemp("ema") / "run"
    over = {**EMA, "train.ema.eval": "true", "train.eval_every": 5, "checkpoint.every": 5,
            "checkpoint.keep": 5}
    assert main(["train", DEFAULT, *tiny_overrides(run_dir, 10, **over)]) == 0
    return run_dir, over


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """5 steps without EMA, saved at every step."""
    run_dir = tmp_path_factory.mktemp("plain") / "run"
    over = {"checkpoint.every": 1, "checkpoint.keep": 10}
    assert main(["train", DEFAULT, *tiny_overrides(run_dir, 5, **over)]) == 0
    return run_dir


def ema_tensors(step_dir) -> dict:
    return {k: v for k, v in checkpoint_tensors(step_dir).items() if k.startswith("ema.")}


def common(step_dir) -> dict:
    return torch.load(step_dir / "dist" / "common.pt", weights_only=False)


def test_eval_logs_both_weights_metrics(ema_run):
    run_dir, _ = ema_run
    evals = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    evals = [r for r in evals if "eval_top1" in r]
    assert [r["step"] for r in evals] == [5, 10]
    assert all("eval_ema_top1" in r and "eval_ema_loss" in r for r in evals)
    assert evals[-1]["eval_ema_loss"] != evals[-1]["eval_loss"]  # other weights scored
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["eval_ema_top1"] == evals[-1]["eval_ema_top1"] and "eval_top1" in metrics
    lines = [x for x in (run_dir / "train.log").read_text().splitlines() if "eval step 10" in x]
    assert lines and "| top1 " in lines[0] and "| ema_top1 " in lines[0]
    assert lines[0].index("| loss ") < lines[0].index("| ema_top1 ")  # raw first


def test_the_ema_survives_resume_exactly(ema_run, tmp_path):
    """The 10-step run rolled back to its step-5 checkpoint, as if it had stopped there, and
    resumed: the EMA at step 10 is the uninterrupted run's, bit for bit."""
    ref_dir, over = ema_run
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_000010")
    (run_dir / "checkpoints" / "latest").write_text("step_000005\n")
    (run_dir / "metrics.json").unlink()
    assert main(["train", DEFAULT, *tiny_overrides(run_dir, 10, **over)]) == 0
    assert "resumed from" in (run_dir / "train.log").read_text()
    ref, got = (ema_tensors(d / "checkpoints" / "step_000010") for d in (ref_dir, run_dir))
    assert ref and ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    assert common(run_dir / "checkpoints" / "step_000010")["ema"]["steps"] == 10
    # the checkpoint's weights file carries the weights, not the EMA
    from safetensors.torch import load_file
    sd = load_file(str(run_dir / "checkpoints" / "step_000010" / "model.safetensors"))
    assert sd and not any(k.startswith("ema.") for k in sd)


def test_a_run_without_ema_keeps_the_checkpoint_format(plain_run):
    step = plain_run / "checkpoints" / "step_000005"
    assert not ema_tensors(step) and "ema" not in common(step)


def test_resuming_a_checkpoint_without_ema_starts_it_from_the_weights(plain_run, tmp_path):
    """A run of a vitgraph without train.ema (its config.yaml has no such key) resumed with
    one: the EMA starts from the step-5 weights, warm-up from n = 0."""
    run_dir = tmp_path / "run"
    shutil.copytree(plain_run, run_dir)
    for s in range(1, 5):
        shutil.rmtree(run_dir / "checkpoints" / f"step_{s:06d}")
    (run_dir / "metrics.json").unlink()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    del saved["train"]["ema"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    over = {**EMA, "checkpoint.every": 1, "checkpoint.keep": 10}
    assert main(["train", DEFAULT, *tiny_overrides(run_dir, 8, **over)]) == 0
    assert "holds no EMA of the weights: the EMA starts from its weights at step 5" in \
        (run_dir / "train.log").read_text()
    ckpts = run_dir / "checkpoints"
    raw = {s: {k: v for k, v in checkpoint_tensors(ckpts / f"step_{s:06d}").items()
               if not k.startswith(("ema.", "optimizer."))} for s in range(5, 9)}
    avg = raw[5]
    for n, s in enumerate(range(6, 9)):
        avg = hand_update(avg, raw[s], min(0.9, (1 + n) / (10 + n)))
    got = {k[4:]: v for k, v in ema_tensors(ckpts / "step_000008").items()}
    assert_close(got, avg)
    assert common(ckpts / "step_000008")["ema"]["steps"] == 3


def test_export_ema_writes_the_ema_tensors(ema_run, tmp_path, capsys):
    run_dir, _ = ema_run
    from safetensors import safe_open
    from safetensors.torch import load_file
    assert main(["export", str(run_dir), "--ema", "--out", str(tmp_path / "ema.safetensors")]) == 0
    assert main(["export", str(run_dir), "--out", str(tmp_path / "raw.safetensors")]) == 0
    ema, raw = (load_file(str(tmp_path / f"{n}.safetensors")) for n in ("ema", "raw"))
    assert ema.keys() == raw.keys()
    stored = ema_tensors(run_dir / "checkpoints" / "step_000010")
    qkv = stored["ema.decoder.layers.self_attention.linear_qkv.weight"]  # [layers, ...]
    assert torch.equal(ema["decoder.layers.1.self_attention.linear_qkv.weight"], qkv[1])
    assert torch.equal(ema["head.weight"], stored["ema.head.weight"])
    assert not torch.equal(ema["head.weight"], raw["head.weight"])
    with safe_open(str(tmp_path / "ema.safetensors"), "pt") as f:
        assert f.metadata()["weights"] == "ema"


def test_eval_ema_scores_the_ema_weights(ema_run, capsys):
    run_dir, over = ema_run
    code = main(["eval", str(run_dir / "config.yaml"), "train.progress=false"])
    assert code == 0
    code = main(["eval", str(run_dir / "config.yaml"), "train.progress=false", "--ema"])
    assert code == 0
    result = json.loads((run_dir / "eval-10-ema.json").read_text())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert result["weights"] == "ema" and "eval_top1" not in result
    assert result["eval_ema_top1"] == pytest.approx(metrics["eval_ema_top1"])
    assert result["eval_ema_loss"] == pytest.approx(metrics["eval_ema_loss"], rel=1e-5)
    raw = json.loads((run_dir / "eval-10.json").read_text())
    assert raw["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-5)


def test_export_and_eval_ema_of_a_run_without_ema_name_the_checkpoint(plain_run, tmp_path,
                                                                      capsys):
    code = main(["export", str(plain_run), "--ema", "--out", str(tmp_path / "x.safetensors")])
    err = capsys.readouterr().err
    assert code == 2 and "step_000005" in err and "no EMA" in err, err
    assert not (tmp_path / "x.safetensors").exists()
    code = main(["eval", str(plain_run / "config.yaml"), "train.progress=false", "--ema"])
    err = capsys.readouterr().err
    assert code == 2 and "step_000005" in err and "no EMA" in err, err


def test_eval_line_puts_the_ema_after_the_raw_metrics():
    from vitgraph.train.evaluate import ema_metrics
    from vitgraph.train.metrics import eval_line
    raw = {"eval_loss": 1.0, "eval_top1": 0.5, "eval_images": 10}
    line = eval_line({**raw, **ema_metrics({"eval_loss": 0.9, "eval_top1": 0.6, "eval_images": 10})})
    assert line == "top1 0.5000 | loss 1.0000 | ema_top1 0.6000 | ema_loss 0.9000"


def test_ema_eval_without_a_decay_is_a_config_error(tmp_path, capsys):
    code = main(["train", DEFAULT, *tiny_overrides(tmp_path / "run", 1), "train.ema.eval=true"])
    err = capsys.readouterr().err
    assert code == 2 and "train.ema.eval=True" in err and "train.ema.decay" in err, err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- GPU: megatron's optimizers

def masters(t) -> dict:
    """The optimizer's fp32 weights by parameter name (one rank, dp 1: every shard is whole)."""
    names = {id(p): n for n, p in t.model.named_parameters()}
    return {names[id(e.param)]: e.master.detach().reshape(e.param.shape).clone()
            for e in t.ema.entries}


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [[], STEP_GRAPHS], ids=["eager", "step-graphs"])
@pytest.mark.parametrize("distributed", [False, True], ids=["bf16-optimizer", "distributed"])
def test_gpu_ema_follows_the_fp32_master_weights_and_resumes(tmp_path, distributed, extra):
    """bf16 model, megatron's optimizer (its fp32 main weights, or the distributed optimizer's
    shards): the EMA is the hand-computed average of the main weights, eval swaps it in as
    bf16 and back, and a resumed run ends with the uninterrupted run's EMA."""
    over = {**EMA, "model.spec": "auto", "train.precision": "bf16",
            "parallel.distributed_optimizer": str(distributed).lower()}
    t = trainer(tmp_path / "drive", *extra, **over)
    try:
        assert t.ema.sharded == distributed
        avg = masters(t)
        for n in range(5):
            one_step(t)
            avg = hand_update(avg, masters(t), min(0.9, (1 + n) / (10 + n)))
            assert_close(t.ema.named(t.chunks), avg)
        raw = weights(t)
        with t.ema.swapped(t.wrapped):
            for name, p in t.model.named_parameters():
                assert torch.equal(p.float(), avg[name].to(p.dtype).float()), name
        assert all(torch.equal(p.float(), raw[n]) for n, p in t.model.named_parameters())
    finally:
        t.close()
    # save at 5 (the EMA gathered into full tensors), load into a new Trainer
    # (this rank's shard taken): exactly the saved EMA, whatever the GPU's reductions do later
    from vitgraph.convert import read_checkpoint_weights
    run_dir = tmp_path / "run"
    over.update({"checkpoint.every": 5, "checkpoint.keep": 5})
    assert main(["train", DEFAULT, *tiny_overrides(run_dir, 5, **over), *extra]) == 0
    saved, _ = read_checkpoint_weights(run_dir / "checkpoints" / "step_000005", ema=True)
    (run_dir / "metrics.json").unlink()
    t = trainer(run_dir, *extra, steps=10, **over)
    try:
        t.maybe_resume()
        assert t.step == 5 and float(t.ema.count) == 5
        got = t.ema.named(t.chunks)
        assert got and all(torch.equal(got[k], saved[k].to(got[k].device)) for k in got)
    finally:
        t.close()


# ---------------------------------------------------------------- dp shards (torchrun, gloo)

def _gather() -> None:
    """Each of 2 ranks holds half of every parameter (as the distributed optimizer's shards:
    contiguous ranges of the flattened parameter, some empty); gather_shards rebuilds them."""
    import torch.distributed as dist
    from vitgraph.train.ema import _Entry, gather_shards
    rank = dist.get_rank()
    full = [torch.arange(12.0).view(3, 4), torch.arange(5.0) + 100, torch.tensor([7.0])]
    spans = [[(0, 5), (5, 12)], [(0, 5), (5, 5)], [(0, 0), (0, 1)]]  # rank 1: none of #2
    entries = []
    for t, s in zip(full, spans):
        a, b = s[rank]
        entries.append(_Entry(torch.nn.Parameter(torch.zeros_like(t)),
                              t.reshape(-1)[a:b] if b > a else None, (a, b), None))
    got = gather_shards(entries, dist.group.WORLD)
    assert all(torch.equal(g, t) for g, t in zip(got, full)), got


def gather_check(out: str) -> None:
    """A call job of the session's launch of two (conftest.launched)."""
    import torch.distributed as dist
    write_result(out, f"rank{dist.get_rank()}", _gather)


def launch_jobs(root) -> dict[int, list]:
    return {2: [("gather", {"call": "test_ema:gather_check",
                            "kwargs": {"out": str(root / "gather")}})]}


@pytest.mark.multiproc
def test_dp_shards_gather_into_full_tensors(launched):
    assert_results(*launched[__name__]["gather"], ["rank0", "rank1"])
