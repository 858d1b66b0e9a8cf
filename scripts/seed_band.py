"""FP8 against bf16 over several seeds: is the FP8 loss curve inside bf16's own seed-to-seed spread?

    python scripts/seed_band.py DIR           # DIR/tiny_{bf16,fp8}_{SEED}/log.jsonl (run folders)
    python scripts/seed_band.py FILE.json     # {"runs": {"tiny_bf16_1234": [records], ...}}
                                              # e.g. benchmarks/h200/fp8-vs-bf16-tiny-seeds.json

Make the runs with `vitgraph train CONFIG train.seed=SEED train.precision=bf16|fp8
run.dir=DIR/tiny_PRECISION_SEED` (benchmarks/BENCHMARKS.md has the command of record).

Prints, for the windowed training loss: each seed's largest relative fp8-bf16 difference, the
largest difference between two bf16 seeds (the run-to-run spread), and the largest relative
difference between the seed-mean fp8 curve and the seed-mean bf16 curve. A single pair cannot
be held to a tolerance tighter than the bf16 spread; the seed means can."""
import json
import sys
from itertools import combinations
from pathlib import Path


def curve(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def worst(a: dict, b: dict) -> float:
    return max(abs(b[s] - a[s]) / abs(a[s]) for s in a if s in b)


def load_runs(src: Path) -> dict[tuple[str, str], dict[int, float]]:
    if src.is_file():
        named = json.loads(src.read_text())["runs"].items()
    else:
        named = [(d.name, [json.loads(x) for x in (d / "log.jsonl").read_text().splitlines()
                           if x.strip()])
                 for d in sorted(src.glob("tiny_*_*")) if (d / "log.jsonl").is_file()]
    runs = {}
    for name, records in named:
        _, prec, seed = name.split("_")
        runs[(prec, seed)] = curve(records)
    return runs


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    runs = load_runs(Path(sys.argv[1]))
    seeds = sorted({s for p, s in runs if ("bf16", s) in runs and ("fp8", s) in runs})
    if not seeds:
        print("no seed has both a bf16 and an fp8 run")
        return 1
    for s in seeds:
        print(f"seed {s}: fp8 vs bf16 {worst(runs['bf16', s], runs['fp8', s]):.2%}")
    spread = max((worst(runs["bf16", a], runs["bf16", b]) for a, b in combinations(seeds, 2)),
                 default=0)
    print(f"bf16 seed against bf16 seed, largest: {spread:.2%}")
    mean = {p: {st: sum(runs[p, s][st] for s in seeds) / len(seeds) for st in runs[p, seeds[0]]}
            for p in ("bf16", "fp8")}
    print(f"seed-mean fp8 curve vs seed-mean bf16 curve ({len(seeds)} seeds): "
          f"{worst(mean['bf16'], mean['fp8']):.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
