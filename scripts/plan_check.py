#!/usr/bin/env python
"""Hold `vitgraph plan` against measured peaks on this GPU: fails unless each is within 10%.

    python scripts/plan_check.py [CONFIG ...] [--bench FILE.json ...] [--set K=V ...] [--out FILE.json]
    scripts/gpu_check.sh plan          # every bundled GPU config, logs under $OUT

A config runs its header's smoke command (scripts/smoke_configs.py; without one: the embedded
data at the config's micro-batch, one microbatch a step) for a few steps; its
measured peak is the log's ``peak_reserved_gib`` (torch.cuda.max_memory_reserved, graph pools
included). A bench JSON's vitgraph rows (scripts/bench.py: ``peak_reserved_gib``) are planned
as configs/vit-b16-imagefolder.yaml with the row's model, micro-batch, precision, graph scope
and recompute. The plan is `vitgraph plan ... --json` with the same overrides, at one GPU.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from smoke_configs import smoke_spec  # noqa: E402

TOLERANCE = 0.10
BENCH_BASE = ROOT / "configs" / "vit-b16-imagefolder.yaml"


def planned(config: Path, over: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-m", "vitgraph", "plan", str(config), *over, "--gpus",
                           "1", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"vitgraph plan {config.name}: exit {proc.returncode}: {proc.stderr[-800:]}")
    return json.loads(proc.stdout)


def measured_run(config: Path, over: list[str], runs: Path, steps: int, timeout: int) -> dict:
    run_dir = runs / config.stem
    cmd = [sys.executable, "-m", "vitgraph", "train", str(config), *over, f"train.steps={steps}",
           f"train.log_every={max(1, steps // 3)}", "train.eval_every=0", f"run.dir={run_dir}",
           "train.progress=false", "checkpoint.resume=false"]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    records = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()
               if x.strip()] if (run_dir / "log.jsonl").is_file() else []
    train = [r for r in records if "peak_reserved_gib" in r]
    if proc.returncode or not train:
        raise RuntimeError(f"{config.name}: exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")
    return {"peak_reserved_gib": max(r["peak_reserved_gib"] for r in train),
            "images_per_s": train[-1]["images_per_s"], "wall_s": round(time.time() - t0, 1)}


def shapes_run(path: Path) -> list[str]:
    """A config without a smoke command runs on the embedded data at its own micro-batch,
    one microbatch a step."""
    from vitgraph.config import load_config
    mb = load_config(path, data=False).train.micro_batch_size
    return ["data.kind=shapes", "data.render_size=32", f"data.num_train={max(2048, mb)}",
            f"train.global_batch_size={mb}", "model.init_from=null"]


def _batch(r: dict) -> tuple[list[str], str]:
    """A bench row's batch as overrides of BENCH_BASE, and its name: a micro-batch of fixed
    images; at native resolution (--native, --vlm) its packs (or padded slots) and the
    language model of a caption row, or the dense caption rows' fixed composition."""
    lm = r.get("lm")
    # bench.py's native and caption rows train without augmentation (no mixing either)
    plain = ["data.augment.enabled=false", "data.augment.mixup_alpha=0",
             "data.augment.cutmix_alpha=0"]
    caption = [] if lm is None else [
        "task.kind=caption", f"lm.num_layers={lm['layers']}", f"lm.hidden_size={lm['width']}",
        f"lm.num_heads={lm['heads']}", f"lm.tokenizer={lm['tokenizer']}",
        f"lm.text_length={lm['text_length']}"]
    attention = r.get("attention")
    if attention == "dense":  # the fixed composition at the max_patches grid
        return ([*plain, *caption, f"model.image_size={r['image_size']}",
                 f"train.micro_batch_size={r['batch']}", f"train.global_batch_size={r['batch']}"],
                f"dense {r['image_size']} px mb{r['batch']}")
    if r.get("resolution") == "native":
        return ([*plain, *caption, "data.resolution=native",
                 f"data.packing.max_patches={r['max_patches']}",
                 f"data.packing.tokens_per_microbatch={r['pack_tokens']}",
                 f"data.packing.max_images={r['max_images']}",
                 f"data.packing.layout={'padded' if attention == 'padded' else 'packed'}",
                 "train.micro_batch_size=1", f"train.global_batch_size={r['microbatches']}"],
                f"{attention} {r['microbatches']} x {r['pack_tokens']} tokens")
    return ([f"train.micro_batch_size={r['micro_batch']}",
             f"train.global_batch_size={r.get('global_batch', r['micro_batch'])}"],
            f"mb{r['micro_batch']}")


def bench_rows(path: Path) -> list[tuple[str, list[str], dict]]:
    out = []
    for r in json.loads(path.read_text())["rows"]:
        if not r["system"].startswith("vitgraph") or r.get("error") or not r.get("peak_reserved_gib"):
            continue
        graphs = r.get("graphs") or "eager"
        batch, shape = _batch(r)
        over = [f"model.name={r['model']}", f"model.num_classes={r.get('num_classes', 10)}",
                *batch,
                f"train.precision={'fp8' if r['precision'].startswith('fp8') else r['precision']}",
                f"train.recompute={r.get('recompute', 'none')}",
                "graphs.enabled=false" if graphs == "eager" else f"graphs.scope={graphs}"]
        if graphs != "eager":
            over.append("graphs.enabled=true")
        if graphs == "layer" and r["precision"].startswith("fp8"):
            over.append("graphs.impl=te")  # bench.py's FP8 layer graphs
        name = f"{path.name}: {r['system']} {r['model']} {shape} {r['precision']} " \
               f"recompute {r.get('recompute', 'none')}"
        out.append((name, over, {"peak_reserved_gib": r["peak_reserved_gib"],
                                 "images_per_s": r["images_per_s"]}))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="*", type=Path, help="default: every configs/*.yaml with spec te")
    ap.add_argument("--bench", nargs="*", type=Path, default=[], help="bench.py JSON files")
    ap.add_argument("--steps", type=int, default=12, help="training steps of each config's run")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
    ap.add_argument("--set", nargs="*", default=[], metavar="K=V",
                    help="overrides added to every config's run and plan (e.g. parallel.fsdp=true)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    configs = args.configs if (args.configs or args.bench) else sorted(
        p for p in (ROOT / "configs").glob("*.yaml") if re.search(r"^\s*spec:\s*te\b", p.read_text(), re.M))
    runs = Path(tempfile.mkdtemp(prefix="vitgraph-plan-"))
    rows, failed = [], 0
    todo = []
    for path in configs:
        path = path.resolve()
        spec = smoke_spec(path)
        todo.append((path.name, path, [*(spec[0][1:] if spec else shapes_run(path)), *args.set],
                     None))
    for b in args.bench:
        todo.extend((name, BENCH_BASE, over, m) for name, over, m in bench_rows(b))
    for name, path, over, meas in todo:
        row = {"name": name, "config": str(path.relative_to(ROOT)), "overrides": over}
        try:
            row.update(meas or measured_run(path, over, runs, args.steps, args.timeout))
            plan = planned(path, over)
            row["plan_gib"] = plan["peak_gib"]
            row["error"] = (plan["peak_gib"] - row["peak_reserved_gib"]) / row["peak_reserved_gib"]
            row["ok"] = abs(row["error"]) <= TOLERANCE
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            row.update(ok=False, failure=str(e)[-1500:])
        failed += not row["ok"]
        rows.append(row)
        if "plan_gib" in row:
            print(f"{'ok  ' if row['ok'] else 'FAIL'} {name}: measured {row['peak_reserved_gib']:.2f} "
                  f"GiB, plan {row['plan_gib']:.2f} GiB ({100 * row['error']:+.1f}%)", flush=True)
        else:
            print(f"FAIL {name}: {row['failure']}", flush=True)
        if args.out:  # after every row: a run stopped by a time limit keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "tolerance":
                                            TOLERANCE, "command": " ".join(sys.argv),
                                            "rows": rows}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
