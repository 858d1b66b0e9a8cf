"""task.kind=caption under parallel layouts on CPU (torchrun, gloo, fp32): dp=2, tp=2 with and
without sequence parallel, and pp=2 (the tower on the first stage) train the loss curve of one
process for the same seed and end on its held-out numbers and greedy captions; a run stopped
after step 5 and resumed continues it."""
from pathlib import Path

import pytest

from conftest import ROOT, loss_records, tiny_overrides

VLM = str(ROOT / "configs" / "vlm-tiny-shapes.yaml")
STEPS = 10
# two language-model layers (one a stage at pp=2); 16 images a step in 4 microbatches of 4
# (per data-parallel rank: 16 / (4 x dp)); 64 held-out images in one eval batch
SMALL = ["lm.num_layers=2", "train.global_batch_size=16", "train.micro_batch_size=4",
         "data.num_val=64", "train.eval_batch_size=64"]
SAVE = ["checkpoint.every=5", "checkpoint.keep=5"]
GRAPHS = ["graphs.enabled=true", "graphs.warmup_steps=2"]  # the CPU rerun backend
LAYOUTS = {
    "dp2": [],
    # greedy captions run the whole sequence for each token (no KV cache)
    "tp2-sp-graphs": ["parallel.tp=2", "parallel.sequence_parallel=true", *GRAPHS],
    "tp2": ["parallel.tp=2"],  # greedy captions through megatron's KV cache, heads split
    "pp2-graphs": ["parallel.pp=2", *GRAPHS],
}


# the one-process run's step-5 checkpoint resumed at another layout
RESUMES = {"one-to-tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
           "one-to-pp2": ["parallel.pp=2"]}


def run_args(run_dir: Path, *extra: str) -> list[str]:
    return [VLM, *tiny_overrides(run_dir, steps=STEPS, **{"train.log_every": 1}), *SMALL,
            *extra]


def launch_jobs(root: Path) -> dict[int, list]:
    """The one-process reference (saved at step 5) and its resume from there; each layout,
    and the reference's step 5 resumed at other layouts."""
    def resume(name, *extra):
        return name, {"args": run_args(root / name, *SAVE, *extra),
                      "resume": {"from": str(root / "one"), "step": 5}}
    return {1: [("one", {"args": run_args(root / "one", *SAVE)}), resume("resumed")],
            2: [*((name, {"args": run_args(root / name, *extra)})
                  for name, extra in LAYOUTS.items()),
                *(resume(name, *extra) for name, extra in RESUMES.items())]}


@pytest.fixture(scope="module")
def runs(launched):
    return launched[__name__]


def losses(run_dir, launch=None) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in loss_records(run_dir, launch)}


def metrics(run_dir) -> dict:
    import json
    return json.loads((Path(run_dir) / "metrics.json").read_text())


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_the_one_process_curve(runs, name):
    ref = losses(*runs["one"])
    got = losses(*runs[name])
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1)), (sorted(ref), sorted(got))
    for s in ref:  # fp32; only the order of reductions differs
        assert got[s] == pytest.approx(ref[s], rel=2e-4), (s, got, ref)
    want, have = metrics(runs["one"][0]), metrics(runs[name][0])
    assert have["eval_images"] == want["eval_images"] == 64
    assert have["eval_caption_loss"] == pytest.approx(want["eval_caption_loss"], rel=2e-4)
    log = (Path(runs[name][0]) / "train.log").read_text()
    if name.startswith("pp2"):  # greedy captions need the whole model on one stage
        assert "eval_class_word_accuracy" not in have
        assert "no greedy captions under parallel.pp=2" in log
    else:  # the same greedy captions (the three logged)
        assert have["eval_class_word_accuracy"] == want["eval_class_word_accuracy"]
        assert captions(log) == captions((Path(runs["one"][0]) / "train.log").read_text())
    if "graphs.enabled=true" in LAYOUTS[name]:
        assert loss_records(runs[name][0])[-1]["graphs_replays"] > 0


def captions(log: str) -> str:
    lines = [x.split("greedy captions: ", 1)[1] for x in log.splitlines()
             if "greedy captions: " in x]
    assert lines, log[-2000:]
    return lines[-1]


@pytest.mark.multiproc
def test_resumed_run_continues_the_curve_exactly(runs):
    """Stopped after step 5 (the run rolled back to its checkpoint) and resumed: steps 6-10
    and the held-out numbers at the end are the uninterrupted run's."""
    ref, got = losses(*runs["one"]), losses(*runs["resumed"])
    assert sorted(got) == list(range(6, STEPS + 1)), sorted(got)
    for s in got:  # bit for bit: the same layout, weights, AdamW state, data and RNG
        assert got[s] == ref[s], (s, got, ref)
    want, have = metrics(runs["one"][0]), metrics(runs["resumed"][0])
    for key in ("eval_caption_loss", "eval_class_word_accuracy"):
        assert have[key] == want[key], key


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(RESUMES))
def test_checkpoint_resumes_at_another_layout(runs, name):
    """The one-process run's step-5 checkpoint resumed at tp=2 + sequence parallel or pp=2:
    steps 6-10 continue its curve (the vocabulary's padded size is the same at tp 1 and 2)."""
    ref, got = losses(*runs["one"]), losses(*runs[name])
    assert sorted(got) == list(range(6, STEPS + 1)), sorted(got)
    for s in got:
        assert got[s] == pytest.approx(ref[s], rel=2e-4), (s, got, ref)
