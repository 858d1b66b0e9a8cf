#!/usr/bin/env python
"""Run each GPU config's header smoke test and check that it learns as the header says.

    python scripts/smoke_configs.py [CONFIG ...] [--out FILE.json] [--timeout S]
    scripts/gpu_check.sh configs          # the same, logs under $OUT

A GPU config (``model.spec: te``) carries in its header a smoke-test command on the embedded
data and the figure the check asks for::

    # Smoke test on the embedded data (... asks held-out top-1 >= 25%). ...
    #   vitgraph train configs/vit-b16-imagefolder.yaml data.kind=shapes ... \\
    #     train.steps=300 ...

The command runs as written (plus ``run.dir``, no progress bar) in a fresh process. The check
fails unless the training loss falls (last logged window below the first) and the held-out
top-1 (zero-shot top-1 for an image-text pair) reaches the header's figure. Prints a table and
writes the measured loss, top-1, img/s and graph path per config as JSON.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASK = re.compile(r"asks (?:held-out (zero-shot )?top-1 >= (\d+(?:\.\d+)?)%|(the training loss to fall))")


def smoke_spec(path: Path) -> tuple[list[str], float] | None:
    """(the smoke command's arguments after ``vitgraph train``, the top-1 asked, 0..1; 0 for a
    header that asks only the training loss to fall: the big towers' few-step runs) from a
    config's header; None for a config without both."""
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line[1:].strip())
    ask = ASK.search(" ".join(header))
    cmd, on = [], False
    for line in header:
        if line.startswith("vitgraph train "):
            on, cmd = True, []
        if on:
            cmd.append(line.rstrip("\\").strip())
            on = line.endswith("\\")
    if not cmd or ask is None:
        return None
    return shlex.split(" ".join(cmd))[2:], float(ask.group(2)) / 100 if ask.group(2) else 0.0


def read_run(run_dir: Path) -> dict:
    """First and last logged training loss, the held-out top-1, img/s and graph path."""
    records = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in records if r.get("loss") is not None]
    evals = [r for r in records if any(k.startswith("eval_") for k in r)]
    last = evals[-1] if evals else {}
    top1 = last.get("eval_zero_shot_top1", last.get("eval_top1"))
    log = (run_dir / "train.log").read_text() if (run_dir / "train.log").is_file() else ""
    graphs = re.search(r"graphs: (\w+) \(", log)
    return {"loss_first": train[0]["loss"] if train else None,
            "loss_last": train[-1]["loss"] if train else None,
            "top1": top1, "images_per_s": train[-1].get("images_per_s") if train else None,
            "graphs": graphs.group(1) if graphs else None, "steps": train[-1]["step"] if train else 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="*", type=Path, help="default: every configs/*.yaml with spec te")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--timeout", type=int, default=240, help="seconds per smoke run")
    ap.add_argument("--runs", type=Path, default=None, help="where the run folders go")
    args = ap.parse_args()
    configs = args.configs or sorted(p for p in (ROOT / "configs").glob("*.yaml")
                                     if re.search(r"^\s*spec:\s*te\b", p.read_text(), re.M))
    runs = args.runs or Path(tempfile.mkdtemp(prefix="vitgraph-smoke-"))
    rows, failed = [], 0
    for path in configs:
        spec = smoke_spec(path)
        if spec is None:
            print(f"{path.name}: no smoke command with an 'asks held-out top-1 >= N%' figure "
                  "in its header", flush=True)
            failed += 1
            continue
        over, ask = spec
        run_dir = runs / path.stem
        cmd = [sys.executable, "-m", "vitgraph", "train", str(path), *over[1:],
               f"run.dir={run_dir}", "train.progress=false", "checkpoint.resume=false"]
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
            code, tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
        except subprocess.TimeoutExpired:
            code, tail = "timeout", ""
        row = {"config": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
               "command": " ".join(["vitgraph train", *over]), "asks_top1": ask, "exit": code,
               "wall_s": round(time.time() - t0, 1)}
        if (run_dir / "log.jsonl").is_file():
            row.update(read_run(run_dir))
        ok = (code == 0 and row.get("loss_last") is not None and row["loss_last"] < row["loss_first"]
              and (ask == 0 or (row.get("top1") is not None and row["top1"] >= ask)))
        row["ok"] = ok
        failed += not ok
        rows.append(row)
        print(f"{path.name:28s} {'ok  ' if ok else 'FAIL'} exit {code} loss "
              f"{row.get('loss_first') or float('nan'):.4f} -> {row.get('loss_last') or float('nan'):.4f} "
              f"top-1 {row.get('top1') or float('nan'):.3f} (asks {ask:.2f}) "
              f"{row.get('images_per_s') or float('nan'):.0f} img/s graphs {row.get('graphs')} "
              f"({row['wall_s']} s)", flush=True)
        if not ok and tail:
            print(tail, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
