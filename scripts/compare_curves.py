"""Compare training curves (log.jsonl files): eager, graphs, graphs resumed from a checkpoint.

    python scripts/compare_curves.py EAGER.jsonl GRAPHS.jsonl [RESUMED.jsonl]

Prints the loss at each logged step side by side, the largest relative difference to the
first file, and the graph counters of the last record (which must show graphs replaying for
every file whose path contains "graph").
Exit code 1 when a difference exceeds --rtol (bf16 default 5e-2) or graphs never replayed.
"""
import argparse
import json
import sys
from pathlib import Path


def load(path):
    recs = [json.loads(line) for line in open(path) if line.strip()]
    return {r["step"]: r for r in recs if "loss" in r}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--rtol", type=float, default=5e-2)
    args = ap.parse_args()
    curves = [load(f) for f in args.files]
    ref = curves[0]
    worst, worst_grad, ok = 0.0, 0.0, True
    names = [Path(f).parent.name if Path(f).name == "log.jsonl" else Path(f).stem for f in args.files]
    print("step  " + "  ".join(f"{n[-12:]:>12s}" for n in names))
    for step in sorted(ref):
        row = [c[step]["loss"] if step in c else float("nan") for c in curves]
        print(f"{step:5d} " + "  ".join(f"{v:12.5f}" for v in row))
        for v in row[1:]:
            if v == v:
                worst = max(worst, abs(v - row[0]) / abs(row[0]))
        g0 = ref[step].get("grad_norm")
        for c in curves[1:]:
            g = c.get(step, {}).get("grad_norm")
            if g0 and g is not None and g == g:
                worst_grad = max(worst_grad, abs(g - g0) / abs(g0))
    steps = sorted(ref)
    # a curve that does not move compares nothing: show how far the reference learned
    print(f"reference loss {ref[steps[0]]['loss']:.4f} at step {steps[0]} -> "
          f"{ref[steps[-1]]['loss']:.4f} at step {steps[-1]}")
    print(f"max relative loss difference to {args.files[0]}: {worst:.2e} (rtol {args.rtol})")
    print(f"max relative grad-norm difference (reported, not gated): {worst_grad:.2e}")
    ok = worst <= args.rtol
    for f, c in zip(args.files[1:], curves[1:]):
        last = c[max(c)]
        replays = last.get("graphs_replays", 0)
        print(f"{f}: last step {max(c)}, graphs {last.get('graphs_graphs')}, replays {replays}, "
              f"captures {last.get('graphs_captures')}")
        if "graph" in f:
            ok = ok and replays > 0
    print("CURVES", "MATCH" if ok else "DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
