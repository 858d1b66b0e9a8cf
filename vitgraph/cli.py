"""``vitgraph train CONFIG [key=value ...]`` (also ``python -m vitgraph``, and under torchrun)."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vitgraph", description="Train vision encoders on megatron-core and TE.")
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train a model from a YAML config",
                        description="Train from CONFIG; key=value pairs override it "
                                    "(e.g. train.steps=100 model.spec=torch).")
    tr.add_argument("config", help="YAML experiment config (see configs/)")
    tr.add_argument("overrides", nargs="*", help="dotted overrides, key=value")
    sub.add_parser("models", help="list the registered model names")
    args = parser.parse_args(argv)

    if args.command == "models":
        from vitgraph.models.registry import ALIASES, MODELS
        for name, a in MODELS.items():
            print(f"{name:28s} width {a.hidden_size:5d} depth {a.num_layers:3d} "
                  f"heads {a.num_heads:3d} patch {a.patch_size:3d} image {a.image_size}")
        for alias, name in ALIASES.items():
            print(f"{alias:28s} -> {name}")
        return 0

    from vitgraph.config import ConfigError, load_config
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"vitgraph: config error: {e}", file=sys.stderr)
        return 2
    from vitgraph.data import DataError
    from vitgraph.train.checkpoint import NoIntactCheckpoint
    from vitgraph.train.loop import TrainingFailed, train
    from vitgraph.train.preempt import PREEMPTED_EXIT, Preempted
    # exit codes: 0 done (or already finished), 2 the user's input (config, data, no usable
    # checkpoint; nothing trained), PREEMPTED_EXIT (75) stopped by a signal with a checkpoint
    # saved (requeue), 1 a failure during training (traceback in train.log)
    try:
        train(cfg)
    except ConfigError as e:  # the run folder holds another run
        print(f"vitgraph: config error: {e}", file=sys.stderr)
        return 2
    except DataError as e:  # unreadable data found after start-up: still the user's input
        print(f"vitgraph: data error: {e}", file=sys.stderr)
        return 2
    except NoIntactCheckpoint as e:
        print(f"vitgraph: checkpoint error: {e}", file=sys.stderr)
        return 2
    except Preempted as e:
        print(f"vitgraph: {e} (exit {PREEMPTED_EXIT})", file=sys.stderr)
        return PREEMPTED_EXIT
    except TrainingFailed as e:
        print(f"vitgraph: {e}", file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
