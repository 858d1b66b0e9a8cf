"""``vitgraph train|eval|export|params|plan|configs|models|cache`` (also ``python -m vitgraph``,
and under torchrun)."""
from __future__ import annotations

import argparse
import faulthandler
import os
import re
import signal
import sys
from pathlib import Path

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vitgraph", description="Train vision encoders on megatron-core and TE.")
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="vitgraph's version and those of torch, megatron-core and "
                             "Transformer Engine")
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train a model from a YAML config",
                        description="Train from CONFIG; key=value pairs override it "
                                    "(e.g. train.steps=100 model.spec=torch).")
    tr.add_argument("config", help="YAML experiment config (see `vitgraph configs`)")
    tr.add_argument("overrides", nargs="*", default=[], help="dotted overrides, key=value")
    _add_eval(sub)
    _add_export(sub)
    pa = sub.add_parser("params", help="list a config's parameters: shape, lr scale, weight "
                        "decay, frozen",
                        description="Build CONFIG's model on CPU (torch spec, one process, no "
                                    "data read, nothing trained) and print one line per "
                                    "parameter: its name (what model.freeze patterns match), "
                                    "shape, lr scale (optim.layer_decay), weight decay on/off "
                                    "and whether model.freeze / task.lock_image freeze it.")
    _config_arguments(pa)
    _add_plan(sub)
    sub.add_parser("configs", help="list the bundled configs with their header lines")
    sub.add_parser("models", help="list the registered model names")
    ca = sub.add_parser("cache", help="show (or --clear) the generated-dataset cache")
    ca.add_argument("--clear", action="store_true", help="delete every cached dataset")
    ca.add_argument("--dir", default=None, help="cache directory (default: data.cache_dir's default)")
    return parser


class _Version(argparse.Action):
    """``--version``: vitgraph's and its engines' versions (from the installed packages'
    metadata: nothing imported, no GPU touched)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from vitgraph import __version__
        print(f"vitgraph {__version__} (" + ", ".join(
            f"{name} {_installed(*dists)}" for name, dists in
            (("torch", ("torch",)), ("megatron-core", ("megatron-core",)),
             ("transformer-engine", ("transformer-engine", "transformer-engine-torch")))) +
            f"; Python {sys.version.split()[0]})")
        parser.exit()


def _installed(*dists: str) -> str:
    """The version of the first of ``dists`` installed, else 'not installed'."""
    from importlib import metadata
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return "not installed"


def _add_eval(sub) -> None:
    ev = sub.add_parser("eval", help="evaluate a run's newest (or a named) checkpoint",
                        description="Evaluate the checkpoint of the run CONFIG describes (with the "
                                    "same overrides as its training); writes "
                                    "<run_dir>/eval-<step>.json and changes nothing else.")
    ev.add_argument("config", help="the run's YAML config, or its run directory (its config.yaml)")
    ev.add_argument("overrides", nargs="*", default=[], help="dotted overrides, key=value")
    ev.add_argument("--checkpoint", help="a step number or a checkpoint directory (default: newest)")
    ev.add_argument("--split", choices=("val", "train"), default="val",
                    help="the held-out split (default) or the training split, unaugmented")
    ev.add_argument("--ema", action="store_true",
                    help="the checkpoint's EMA of the weights (train.ema); writes "
                         "eval-<step>-ema.json, metrics named eval_ema_*")


def _add_export(sub) -> None:
    ex = sub.add_parser("export", help="write a run's model weights as safetensors",
                        description="Write the model weights of RUN_DIR's newest (or a named) "
                                    "checkpoint as safetensors, with vitgraph, timm, Hugging "
                                    "Face or open_clip parameter names (open_clip: CLIP image "
                                    "towers and pairs, not classifiers; hf of a task.kind: "
                                    "caption run: its vision tower as transformers' "
                                    "SiglipVisionModel, or Siglip2VisionModel where the tower "
                                    "is NaFlex-like; vitgraph of a caption run: the whole "
                                    "model, tower, projector and language model, with "
                                    "config.json beside it).")
    ex.add_argument("run_dir")
    ex.add_argument("--format", default="vitgraph", choices=("vitgraph", "timm", "timm_naflex", "hf", "open_clip"),
                    help="timm of a data.resolution=native run writes timm's NaFlexVit names "
                         "(timm_naflex)")
    ex.add_argument("--out", required=True, help="a .safetensors file, or a folder (any other "
                    "path; made if need be), which gets model.safetensors, the name "
                    "from_pretrained(DIR) / create_model('local-dir:DIR') read; hf writes "
                    "config.json and preprocessor_config.json beside the weights, timm "
                    "config.json")
    ex.add_argument("--checkpoint", help="a step number or a checkpoint directory (default: newest)")
    ex.add_argument("--ema", action="store_true",
                    help="the EMA of the weights (train.ema, fp32) instead of the weights")


def _add_plan(sub) -> None:
    pl = sub.add_parser("plan", help="GPU memory per stage of a config's layout, the largest "
                        "micro-batch that fits, and what would fit when it does not",
                        description="Count, on CPU and before any run, what CONFIG holds on "
                                    "each GPU of its layout: weights, gradients, optimizer "
                                    "state (sharded by the distributed optimizer), EMA, "
                                    "activations of the microbatches in flight (with the "
                                    "config's train.recompute) and a runtime share; then the "
                                    "largest micro-batch that fits --gpu-mem, with and "
                                    "without full recompute, and, when it does not fit, "
                                    "which of recompute, tp, pp or more data-parallel ranks "
                                    "would. Exits 1 when it does not fit.")
    _config_arguments(pl)
    pl.add_argument("--gpus", type=_above_zero(int), default=None,
                    help="world size (default: parallel.tp x parallel.pp, i.e. dp 1)")
    pl.add_argument("--gpu-mem", type=_above_zero(float), default=None,
                    help="memory per GPU in GiB (default: this machine's first GPU by "
                         "nvidia-smi, else 139.8: an H200 as torch reports it, and the plan says so; an "
                         "H100: 79.1)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON instead")


def _above_zero(kind):
    """An argparse type: a number of ``kind`` above 0 (argparse names the flag, exit 2)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value
    return parse


def _config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML experiment config")
    p.add_argument("overrides", nargs="*", default=[], help="dotted overrides, key=value")


def main(argv: list[str] | None = None) -> int:
    from vitgraph import INTERRUPTED_EXIT
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # a closed pipe raises here, where it is caught, not at exit
    except KeyboardInterrupt:  # Ctrl-C in a command other than train (train records it)
        print(f"vitgraph: interrupted (exit {INTERRUPTED_EXIT})", file=sys.stderr)
        return INTERRUPTED_EXIT
    except BrokenPipeError:  # the reader went away (`vitgraph models | head`): stop quietly
        # stdout's buffer still holds lines for the closed pipe; the flush at exit would
        # raise again, so it goes to /dev/null
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _main(argv: list[str] | None) -> int:
    from vitgraph import StopSignals, set_hardware_queues
    set_hardware_queues()  # before any import below can initialise CUDA
    parser = _parser()
    args = parser.parse_args(argv)
    _stacks_on_usr2()
    if args.command == "models":
        return _models()
    if args.command == "configs":
        return _configs()
    if args.command == "cache":
        return _cache(args)
    if args.command == "export":
        return _export(args)
    if args.command == "params":
        return _params(args)
    if args.command == "plan":
        return _plan(args)
    # a stop signal from here on is recorded, and stops the run at its next start-up
    # milestone (exit 75; SIGINT 130); the imports below take seconds, and would die of it
    # unsaid (143) or with a KeyboardInterrupt traceback
    signals = StopSignals().install() if args.command == "train" else None
    try:
        from vitgraph.config import ConfigError, check_layout, load_config
        try:
            cfg = load_config(args.config, args.overrides)
            # torchrun's world size (1 without torchrun): a layout that cannot run stops here
            check_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")), args.config)
        except ConfigError as e:
            print(f"vitgraph: config error: {e}", file=sys.stderr)
            return 2
        return _run(cfg, args, signals)
    finally:
        if signals is not None:
            signals.restore()


def _stacks_on_usr2() -> None:
    """`kill -USR2 PID` prints every thread's Python stack to stderr: where a hung rank waits."""
    if hasattr(signal, "SIGUSR2") and sys.__stderr__ is not None:
        try:
            faulthandler.register(signal.SIGUSR2, file=sys.__stderr__, all_threads=True)
        except (OSError, ValueError):  # no file descriptor behind stderr (embedded callers)
            pass


def _run(cfg, args, signals=None) -> int:
    """Train, or evaluate a checkpoint (``vitgraph eval``); the exit code. ``signals``: the
    stop signals recorded since launch (vitgraph.StopSignals)."""
    from vitgraph.config import ConfigError
    from vitgraph.convert import ConvertError
    from vitgraph.data import DataError
    from vitgraph.convert.checkpoints import CheckpointMismatch
    from vitgraph.train.checkpoint import NoIntactCheckpoint
    from vitgraph.train.loop import TrainingFailed
    from vitgraph.train.preempt import Preempted
    # exit codes: 0 done (or already finished), 2 the user's input (config, data, weights, no
    # usable checkpoint; nothing trained), PREEMPTED_EXIT (75) stopped by a signal: with a
    # checkpoint saved, or during start-up with nothing to save (requeue either way),
    # INTERRUPTED_EXIT (130) the same for a SIGINT (Ctrl-C), 1 a failure during training
    # (traceback in train.log)
    try:
        if args.command == "eval":
            from vitgraph.train.evaluate import evaluate_checkpoint
            evaluate_checkpoint(cfg, args.checkpoint, args.split, args.ema)  # prints its line
        else:
            from vitgraph.train.loop import train
            train(cfg, signals)
    except ConfigError as e:  # the run folder holds another run
        print(f"vitgraph: config error: {e}", file=sys.stderr)
        return 2
    except (DataError, ConvertError) as e:  # found after start-up: still the user's input
        print(f"vitgraph: {'data' if isinstance(e, DataError) else 'weights'} error: {e}",
              file=sys.stderr)
        return 2
    except (NoIntactCheckpoint, CheckpointMismatch) as e:
        print(f"vitgraph: checkpoint error: {e}", file=sys.stderr)
        return 2
    except Preempted as e:
        print(f"vitgraph: {e} (exit {e.exit_code})", file=sys.stderr)
        return e.exit_code
    except TrainingFailed as e:
        print(f"vitgraph: {e}", file=sys.stderr)
        return 1
    return 0


def _models() -> int:
    from vitgraph.models.registry import ALIASES, CLIP_MODELS, MODELS

    def tower(a):
        return (f"width {a.hidden_size:4d} depth {a.num_layers:2d} heads {a.num_heads:2d} "
                f"patch {a.patch_size:2d} image {a.image_size}")
    print("classifiers (task.kind classification):")
    for name, a in MODELS.items():
        print(f"  {name:24s} {tower(a)}")
    for alias, name in ALIASES.items():
        print(f"  {alias:24s} -> {name}")
    print("image-text pairs (task.kind contrastive; CLIP / SigLIP):")
    for name, p in CLIP_MODELS.items():
        t = p.text
        print(f"  {name:24s} image: {tower(p.vision)} | text: width {t.hidden_size} depth "
              f"{t.num_layers} heads {t.num_heads} context {t.context_length} | "
              f"embed {p.embed_dim}")
    return 0


def _params(args) -> int:
    """`vitgraph params`: the model of a config, built as training builds it, one line per
    parameter. At one process and tp = pp = 1: the names are the global ones that model.freeze
    matches at every layout (vitgraph.models.freeze.global_names)."""
    if "torch" not in sys.modules:  # nothing here needs a GPU: stay off it
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from vitgraph.config import ConfigError, load_config
    from vitgraph.data import DataError, class_count
    from vitgraph.memory import SINGLE, single_process_chunks
    try:
        cfg = load_config(args.config, [*args.overrides, *SINGLE])
    except ConfigError as e:
        print(f"vitgraph: config error: {e}", file=sys.stderr)
        return 2
    from vitgraph.parallel.setup import shutdown
    from vitgraph.models.freeze import global_names
    from vitgraph.output import plural
    from vitgraph.plan import lr_rules
    from vitgraph.train.optim import _no_decay, lr_scales
    try:
        chunks, _ = single_process_chunks(cfg, cfg.model.num_classes or class_count(cfg.data))
        scales = lr_scales(chunks, cfg.optim.layer_decay, lr_rules(cfg))
        names = global_names(chunks[0])
        rows = [(names[id(p)], "x".join(map(str, p.shape)) or "scalar", p.numel(),
                 scales[id(p)], not _no_decay(names[id(p)], p), p.requires_grad)
                for p in chunks[0].parameters()]
    except (ConfigError, DataError) as e:
        print(f"vitgraph: {'config' if isinstance(e, ConfigError) else 'data'} error: {e}",
              file=sys.stderr)
        return 2
    finally:
        shutdown()
    width = max(len(r[0]) for r in rows)
    print(f"{'name':{width}s}  {'shape':>14s}  {'lr scale':>9s}  wd   frozen")
    for name, shape, _, s, wd, trains in rows:
        print(f"{name:{width}s}  {shape:>14s}  {s:9.4g}  {'on ' if wd else 'off'}  "
              f"{'no' if trains else 'yes'}")
    frozen = [r for r in rows if not r[5]]
    print(f"{plural(len(rows), 'parameter tensor')}, {sum(r[2] for r in rows):,} elements; "
          f"frozen: {plural(len(frozen), 'tensor')}, {sum(r[2] for r in frozen):,} elements; "
          f"optim.layer_decay={cfg.optim.layer_decay}")
    return 0


def _plan(args) -> int:
    """`vitgraph plan`: vitgraph.memory's count for a config (CPU only, nothing trained)."""
    gpu_mem, source = (args.gpu_mem, "--gpu-mem") if args.gpu_mem is not None else _gpu_mem_gib()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the model is built on the meta device, on CPU
    from vitgraph.config import ConfigError
    from vitgraph.memory import report
    try:
        text, fits = report(args.config, args.overrides, args.gpus, gpu_mem, as_json=args.json,
                            gpu_mem_source=source)
    except ConfigError as e:
        print(f"vitgraph: config error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0 if fits else 1


H200_GIB = 139.8  # an H200's memory as torch reports it


def _gpu_mem_gib() -> tuple[float, str]:
    """The first GPU's memory by nvidia-smi (torch would take the GPU), else an H200's; and
    where the number came from, for the plan to say."""
    import shutil
    import subprocess
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,"
                            "nounits"], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.split():
            return int(r.stdout.split()[0]) / 1024, "this machine's first GPU (nvidia-smi)"
    return H200_GIB, "no GPU found: an H200 assumed; --gpu-mem sets it"


def _configs() -> int:
    files = sorted(CONFIGS_DIR.glob("*.yaml"))
    if not files:
        print(f"no bundled configs in {CONFIGS_DIR}", file=sys.stderr)
        return 1
    for f in files:
        header = []
        for line in f.read_text().splitlines():
            if not line.startswith("#"):
                break
            header.append(line[1:].strip())
        sentences = _SENTENCE_END.split(" ".join(header))
        first = sentences[0].strip()
        if len(first) < 40 and len(sentences) > 1:  # "name: the default" says too little
            first += ". " + sentences[1].strip()
        print(f"{str(f.relative_to(CONFIGS_DIR.parent)):36s} {first}")
    return 0


# a full stop and a space: a sentence's end, but not after an abbreviation ("Touvron et al.
# 2021", "e.g. DeiT", "vs. timm")
_SENTENCE_END = re.compile(r"(?<!\bal)(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)(?<!\bcf)\.\s+")


def _cache(args) -> int:
    from vitgraph.data import DataConfig
    from vitgraph.data.shapes import cache_files
    from vitgraph.output import plural
    cache_dir = os.path.expanduser(args.dir or DataConfig().cache_dir)
    if args.dir and not os.path.isdir(cache_dir):  # the default is made by the first run
        what = "is not a folder" if os.path.exists(cache_dir) else "does not exist"
        print(f"vitgraph: cache: --dir {args.dir}: {what}", file=sys.stderr)
        return 2
    files = cache_files(cache_dir)
    size = sum(os.path.getsize(f) for f in files)
    if args.clear:
        for f in files:
            os.remove(f)
        print(f"{cache_dir}: removed {plural(len(files), 'cached dataset split')} "
              f"({size / 2**20:.1f} MB)")
    else:
        print(f"{cache_dir}: {plural(len(files), 'cached dataset split')}, {size / 2**20:.1f} MB "
              f"(limit data.cache_max_mb={DataConfig().cache_max_mb:.0f})")
    return 0


def _export(args) -> int:
    import json

    from vitgraph.config import ConfigError, run_model_config
    from vitgraph.convert import ConvertError, read_checkpoint_weights, save_safetensors
    from vitgraph.convert.checkpoints import find_checkpoint
    from vitgraph.output import write_text
    run_dir = Path(args.run_dir)
    try:
        weights = _export_path(args.out)
        model_cfg, raw = run_model_config(run_dir)
        path, passed = find_checkpoint(run_dir, args.checkpoint)
        sd, step = read_checkpoint_weights(path, ema=args.ema)
        out, sidecars, fmt, what = _export_weights(args, run_dir, raw, model_cfg, sd)
        meta = {"format": "pt", "vitgraph_format": fmt, "step": step,
                **({"weights": "ema"} if args.ema else {}),
                "checkpoint": str(path), "model": model_cfg.name, **sidecars.pop("meta")}
        texts = {weights.parent / name: json.dumps(content, indent=2) + "\n"
                 for name, content in sidecars.items()}
        for side, text in texts.items():  # before anything is written
            if side.is_file() and side.read_text() != text:
                raise ConvertError(
                    f"{side} exists and describes another model: --format {fmt} writes "
                    f"{', '.join(sidecars)} beside the weights, read from the folder, so one "
                    f"export per folder; export into another folder or remove it")
    except (ConfigError, ConvertError) as e:
        print(f"vitgraph: export: {e}", file=sys.stderr)
        return 2
    target = weights
    try:
        written = save_safetensors(out, weights, meta)
        for target, text in texts.items():
            write_text(target, text)
    except OSError as e:  # its temporary file is gone (vitgraph.output.written_whole)
        print(f"vitgraph: export: --out {args.out}: cannot write {target}: {e.strerror or e}",
              file=sys.stderr)
        return 2
    for line in passed:  # as training says it when it resumes
        print(f"vitgraph: export: checkpoint {line}; passed over it", file=sys.stderr)
    print(f"{written}: {what}, from checkpoint {path} (step {step})")
    for side in texts:
        why = ("the caption model's geometry and tokenizer, also in the weights' metadata"
               if fmt == "vitgraph" else f"{fmt}'s loaders read it from the folder")
        print(f"{side}: written beside them ({why})")
    return 0


def _export_path(out: str) -> Path:
    """The weights file ``--out`` names: a path ending in .safetensors is that file; any other
    path is a folder, which gets model.safetensors (the name Hugging Face's
    from_pretrained(DIR) and timm's create_model('local-dir:DIR') read) and the side files.
    ConvertError, before any work, where the folder cannot be made or written (``unwritable``)."""
    from vitgraph.convert import ConvertError
    from vitgraph.output import unwritable
    given = Path(out).expanduser()
    weights = given if given.suffix == ".safetensors" and not given.is_dir() else (
        given / "model.safetensors")
    if given.is_file() and weights != given:
        raise ConvertError(f"--out {out}: a file that is not .safetensors; --out is a "
                           f".safetensors file or a folder (written as <folder>/model.safetensors)")
    why = unwritable(weights.parent)
    if why:
        raise ConvertError(f"--out {out}: {why}")
    return weights


def _export_weights(args, run_dir: Path, raw: dict, model_cfg, sd: dict):
    """(the weights under ``args.format``'s names, {side file: content, "meta": safetensors
    metadata}, the format written, what the command says they are)."""
    from vitgraph.convert import ConvertError, export_files, from_vitgraph, vlm
    from vitgraph.convert.naflex import export_format
    from vitgraph.models.registry import CLIP_MODELS, resolve_arch
    native = (raw.get("data") or {}).get("resolution") == "native"
    caption = (raw.get("task") or {}).get("kind") == "caption"
    if caption and args.format == "vitgraph":  # the whole VLM, its geometry beside it
        out = from_vitgraph(sd, "vitgraph", 0)
        config = vlm.vlm_config(out, model_cfg, raw.get("lm") or {})
        meta = {"preprocessing": export_files.preprocessing(resolve_arch(model_cfg).image_size),
                vlm.META_KEY: config}
        return out, {"config.json": config, "meta": meta}, "vitgraph", (
            "the whole caption model: tower, projector and language model (vitgraph names)")
    if caption and args.format != "hf":
        raise ConvertError(f"--format {args.format} of a task.kind: caption run: vitgraph "
                           f"(the whole model) or hf (its vision tower)")
    if args.format == "hf" and caption:
        out, sidecars, cls = export_files.hf_vision_export(sd, model_cfg, native)
        sidecars["meta"] = {"preprocessing": export_files.preprocessing(
            resolve_arch(model_cfg).image_size)}
        return out, sidecars, "hf", (f"the vision tower as transformers' {cls} (hf names; the "
                                     f"projector and the language model are not in it)")
    if model_cfg.name in CLIP_MODELS:  # an image-text pair: both towers' head counts
        pair = CLIP_MODELS[model_cfg.name]
        arch, heads = pair.vision, (pair.vision.num_heads, pair.text.num_heads)
    else:
        arch = resolve_arch(model_cfg)
        heads = (arch.num_heads, None)
    fmt = export_format(args.format, native)
    out = from_vitgraph(sd, fmt, *heads)
    n = int(sd["head.weight"].shape[0]) if "head.weight" in sd else 0
    classes = export_files.read_classes(run_dir, n or None)  # a pair has no head
    meta = {"preprocessing": export_files.preprocessing(arch.image_size)}
    if classes:
        meta["classes"] = classes
    sidecars = {}
    if fmt == "hf":
        sidecars = {"config.json": export_files.hf_config(arch, model_cfg, n, classes),
                    "preprocessor_config.json":
                        export_files.hf_preprocessor_config(arch.image_size)}
    elif fmt == "timm":
        sidecars = {"config.json": export_files.timm_config(model_cfg.name, arch, model_cfg,
                                                            n, classes)}
    elif fmt == "timm_naflex":
        sidecars = {"config.json": export_files.timm_naflex_config_for(model_cfg, n, classes)}
    return out, {**sidecars, "meta": meta}, fmt, f"the weights ({fmt} names)"


if __name__ == "__main__":
    raise SystemExit(main())
