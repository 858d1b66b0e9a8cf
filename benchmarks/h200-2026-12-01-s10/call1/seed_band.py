"""FP8 against bf16 over several seeds (prepared in session 9 for the next device call).

    python seed_band.py DIR    (DIR/tiny_{bf16,fp8}_{seed}/log.jsonl)

Prints, for the windowed training loss: each seed's largest relative fp8-bf16 difference, the
largest difference between two bf16 seeds (the run-to-run spread), and the largest relative
difference between the seed-mean fp8 curve and the seed-mean bf16 curve."""
import json
import sys
from itertools import combinations
from pathlib import Path


def curve(path: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def worst(a: dict, b: dict) -> float:
    return max(abs(b[s] - a[s]) / abs(a[s]) for s in a if s in b)


def main() -> int:
    root = Path(sys.argv[1])
    runs = {}
    for d in sorted(root.glob("tiny_*_*")):
        if (d / "log.jsonl").is_file():
            _, prec, seed = d.name.split("_")
            runs[(prec, seed)] = curve(d / "log.jsonl")
    seeds = sorted({s for p, s in runs if (("bf16", s) in runs and ("fp8", s) in runs)})
    for s in seeds:
        print(f"seed {s}: fp8 vs bf16 {worst(runs['bf16', s], runs['fp8', s]):.2%}")
    spread = max((worst(runs["bf16", a], runs["bf16", b]) for a, b in combinations(seeds, 2)), default=0)
    print(f"bf16 seed against bf16 seed, largest: {spread:.2%}")
    mean = {p: {st: sum(runs[p, s][st] for s in seeds) / len(seeds) for st in runs[p, seeds[0]]}
            for p in ("bf16", "fp8")}
    print(f"seed-mean fp8 curve vs seed-mean bf16 curve ({len(seeds)} seeds): "
          f"{worst(mean['bf16'], mean['fp8']):.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
