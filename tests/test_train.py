"""End-to-end training on CPU: metrics, checkpoints, kill + resume, multi-process layouts."""
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, tiny_overrides, vitgraph_cmd
from test_reliability import _children

DEFAULT = str(ROOT / "configs" / "vit-tiny-shapes.yaml")


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_log(run_dir) if "loss" in r}


def run(env, *args, timeout=300):
    r = subprocess.run(vitgraph_cmd("train", DEFAULT, *args), env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def test_train_end_to_end_writes_metrics_and_run_dir(tmp_path, env):
    r = run(env, *tiny_overrides(tmp_path / "run", steps=30, **{"train.eval_every": 15,
                                                                 "train.tensorboard": "true"}))
    run_dir = tmp_path / "run"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    hits = metrics["eval_top1"] * 200  # a share of the 200 held-out images
    assert metrics["step"] == 30 and metrics["eval_images"] == 200
    assert 0 <= round(hits) <= 200 and hits == pytest.approx(round(hits), abs=1e-3), metrics
    assert str((run_dir / "metrics.json").resolve()) in r.stdout
    assert (run_dir / "config.yaml").is_file() and (run_dir / "train.log").is_file()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    log = read_log(run_dir)
    for key in ("loss", "lr", "grad_norm", "images_per_s", "tflops_per_gpu", "peak_mem_gib"):
        assert all(key in rec for rec in log if "loss" in rec), key
    # no MFU where the device's peak is not known (CPU), rather than 0.0%
    assert not any("mfu" in rec for rec in log) and "mfu" not in metrics
    lines = [x for x in (run_dir / "train.log").read_text().splitlines() if " step " in x
             and "/30 |" in x]
    assert lines and all("| eta " in x and "MFU" not in x for x in lines), lines
    assert "augmentation: off" in (run_dir / "train.log").read_text()
    assert [rec["step"] for rec in log if "eval_top1" in rec] == [15, 30]
    losses = train_losses(run_dir)
    assert losses[30] < losses[5], losses  # it learns something in 30 steps
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000030"


def test_start_up_log_names_drop_path_layer_decay_and_the_decode(tmp_path):
    """What shapes training beyond the architecture is in the log, not only in config.yaml:
    drop path, the optimizer with its layer decay, where the images are decoded (CPU too)."""
    from test_reliability import _folder
    from vitgraph.config import load_config
    from vitgraph.train.loop import Trainer
    data = _folder(tmp_path / "data")
    cfg = load_config(DEFAULT, ["data.kind=imagefolder", f"data.path={data}",
                                "data.preload=false", "model.drop_path_rate=0.1",
                                "optim.layer_decay=0.75", *tiny_overrides(tmp_path / "run")])
    t = Trainer(cfg)
    t.close()
    log = (tmp_path / "run" / "train.log").read_text()
    assert "48 train / 8 held-out images, 2 classes, decoded on the CPU in 2 threads " \
           "(data.decode=auto: no GPU)" in log, log
    assert "drop path 0.1 (model.drop_path_rate)" in log, log
    depth = 4  # vit_pico_patch4_32
    assert (f"optim: AdamW lr 1.50e-03 -> 1.00e-05, weight decay 0.05, grad clip 1, layer decay "
            f"0.75 (encoder layer i of L at lr x 0.75^(L + 1 - i), the embeddings x "
            f"{0.75 ** (depth + 1):.3g}, the head x 1)") in log, log


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    """Running or sleeping: a killed orphan may stay a zombie where nothing reaps it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def test_killed_run_resumes_and_continues_the_loss_curve(tmp_path, env, capsys):
    """Only the killed run is a process of its own; the reference and the resume run here."""
    from vitgraph.cli import main
    steps, every = 30, 5
    over = dict(**{"checkpoint.every": every, "checkpoint.keep": 10})
    ref_dir, dir_ = tmp_path / "ref", tmp_path / "killed"
    assert main(["train", DEFAULT, *tiny_overrides(ref_dir, steps=steps, **over)]) == 0

    cmd = vitgraph_cmd("train", DEFAULT, *tiny_overrides(dir_, steps=steps, **over))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = dir_ / "checkpoints" / "latest"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip() >= "step_000010":
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    helpers = [pid for pid in _children(proc.pid) if b"multiprocessing.spawn" in _cmdline(pid)]
    assert helpers  # megatron's checkpoint-writer helper, started before training
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 20  # it ignores SIGTERM; the kernel's parent-death signal ends it
    while time.time() < deadline and any(_alive(pid) for pid in helpers):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in helpers), "the writer helper outlived the killed run"
    killed_at = int(latest.read_text().strip().split("_")[1])
    assert killed_at < steps
    # a half-written checkpoint of a later step must never be loaded
    half = dir_ / "checkpoints" / f"step_{killed_at + every:06d}.tmp"
    half.mkdir(exist_ok=True)
    (half / "mp_rank_00_000.pt").write_bytes(b"garbage")

    capsys.readouterr()
    assert main(["train", DEFAULT, *tiny_overrides(dir_, steps=steps, **over)]) == 0
    assert f"at step {killed_at}" in capsys.readouterr().out
    assert not half.exists()  # cleaned by the next save
    ref, got = train_losses(ref_dir), train_losses(dir_)
    after = [s for s in ref if s > killed_at]
    assert after and all(s in got for s in after)
    for s in after:  # the same curve as the uninterrupted run
        assert got[s] == pytest.approx(ref[s], rel=1e-5, abs=1e-6), (s, got[s], ref[s])




def test_capturable_adamw_checkpoints_in_te_layout_without_touching_live_state():
    """graphs.scope=step's inner optimizer: its state dict carries the step count in the param
    group (TE FusedAdam's layout, which megatron's checkpoint code expects) and saving leaves
    the live state alone -- a captured step keeps using those step tensors (a GPU test caught
    the first version popping them). Loading puts a device-side step back on every parameter."""
    from vitgraph.train.optim import CapturableAdamW
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    opt = CapturableAdamW([{"params": params, "wd_mult": 0.0}], lr=1e-3, betas=(0.9, 0.99),
                          eps=1e-8, weight_decay=0.0)
    opt.complete_state()
    for p in params:
        opt.state[p]["step"].fill_(7)
        opt.state[p]["exp_avg"].fill_(0.5)
    live = {id(p): opt.state[p]["step"] for p in params}
    sd = opt.state_dict()
    assert all(opt.state[p]["step"] is live[id(p)] for p in params)  # untouched
    assert sd["param_groups"][0]["step"] == 7 and sd["param_groups"][0]["wd_mult"] == 0.0
    assert all("step" not in st for st in sd["state"].values())
    other = CapturableAdamW([{"params": [torch.nn.Parameter(torch.zeros(3)),
                                         torch.nn.Parameter(torch.zeros(2))], "wd_mult": 0.0}],
                            lr=1e-3)
    other.load_state_dict(sd)
    # loaded, the count waits in the group: megatron's distributed optimizer copies the
    # moments in key by key next, and a per-parameter 'step' had no source there (a GPU test's
    # KeyError); complete_state (before the next step or capture) hands it out
    for p in other.param_groups[0]["params"]:
        assert "step" not in other.state[p] and other.state[p]["exp_avg"][0] == 0.5
    assert other.param_groups[0]["step"] == 7
    other.complete_state()
    for p in other.param_groups[0]["params"]:
        assert float(other.state[p]["step"]) == 7 and other.state[p]["exp_avg"][0] == 0.5
    assert "step" not in other.param_groups[0]
    # torch's layout (a step per parameter) loads to the same
    torch_sd = {**sd, "state": {k: {**v, "step": torch.tensor(7.0)} for k, v in sd["state"].items()},
                "param_groups": [{k: v for k, v in g.items() if k != "step"}
                                 for g in sd["param_groups"]]}
    other.load_state_dict(torch_sd)
    other.complete_state()
    assert all(float(other.state[p]["step"]) == 7 for p in other.param_groups[0]["params"])
    # megatron's distributed optimizer loads the moments separately: a group step, no state
    bare = CapturableAdamW([{"params": [torch.nn.Parameter(torch.zeros(3))]}], lr=1e-3)
    bare.load_state_dict({"state": {}, "param_groups": [{**sd["param_groups"][0], "params": [0]}]})
    bare.complete_state()
    assert float(bare.state[bare.param_groups[0]["params"][0]]["step"]) == 7
    # ... or as empty moments it then fills key by key: their keys must be just those
    filled = CapturableAdamW([{"params": [torch.nn.Parameter(torch.zeros(3))]}], lr=1e-3)
    filled.load_state_dict({"state": {0: {"exp_avg": torch.empty(3), "exp_avg_sq": torch.empty(3)}},
                            "param_groups": [{**sd["param_groups"][0], "params": [0]}]})
    assert set(filled.state[filled.param_groups[0]["params"][0]]) == {"exp_avg", "exp_avg_sq"}
