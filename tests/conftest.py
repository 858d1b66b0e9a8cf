import contextlib
import json
import logging
import os
import random
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from vitgraph import set_hardware_queues

set_hardware_queues()  # in-process GPU tests run as `vitgraph train` does (before CUDA starts)
import torch  # noqa: E402

from vitgraph.data.loader import MEAN, STD  # noqa: E402
from vitgraph.parallel.fsdp import local  # noqa: E402

# CPU: one intra-op thread in this process, whatever a Trainer asks for (vitgraph.parallel.setup
# takes cpu_count / local ranks): the suite's models are width 64, too small to split, and two
# threads on two shared cores wait on each other in every op. tests/test_clip.py took 114 s
# at two threads and 37 s at one (its CLIP fit 46 s and 8 s) on a 2-core machine with other
# work on it. Subprocesses choose their own (torchrun's ranks: one each).
if not torch.cuda.is_available():
    _set_num_threads = torch.set_num_threads
    torch.set_num_threads = lambda n: _set_num_threads(1)
    _set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    # the modules whose tests read the session's launches run last (whole modules: their
    # module fixtures are made once): the launches train in the background meanwhile
    late = {i.module for i in items if "launched" in i.fixturenames}
    items[:] = [i for i in items if i.module not in late] + [i for i in items if i.module in late]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the H200: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def write_photos(root: Path, n: int, sizes: list[tuple[int, int]]) -> None:
    """An ImageFolder of ``n`` images a split in two classes: sawtooth-and-noise JPEGs of the
    (w, h) ``sizes`` in turn, image 4 a PNG and image 7 a CMYK JPEG (both decoded by the
    loader's threads, never nvJPEG)."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for i in range(n):
            w, h = sizes[i % len(sizes)]
            y, x = np.mgrid[0:h, 0:w]
            img = np.stack([(x * (i + 1)) % 256, (y * 2) % 256, (x + y) % 256], -1)
            img = (img + rng.integers(-10, 10, img.shape)).clip(0, 255).astype(np.uint8)
            d = root / split / f"c{i % 2}"
            d.mkdir(parents=True, exist_ok=True)
            im = Image.fromarray(img)
            if i == 4:
                im.save(d / f"{i}.png")
            elif i == 7:
                im.convert("CMYK").save(d / f"{i}.jpg", quality=95)
            else:
                im.save(d / f"{i}.jpg", quality=95)


def free_port() -> int:
    """A free port below the kernel's ephemeral range: a port the kernel handed out (bind to 0)
    and released could be given to another process's outgoing gloo connection before torchrun
    listens on it (EADDRINUSE failed a whole launch of 30 tests once)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.SystemRandom().sample(range(20000, max(low, 20001)), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def vitgraph_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "vitgraph", *args]


def tiny_overrides(run_dir, steps=20, **extra) -> list[str]:
    """A seconds-long CPU run: small data, no TensorBoard, no progress bar."""
    base = {"train.steps": steps, "train.log_every": 5, "train.eval_every": 0,
            "train.eval_batch_size": 100, "data.num_train": 512, "data.num_val": 200,
            "train.tensorboard": "false", "train.progress": "false", "run.dir": str(run_dir),
            "model.spec": "torch"}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def clean_env() -> dict:
    """The environment for a vitgraph subprocess: this checkout first, no torchrun variables."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["PYTHONWARNINGS"] = "ignore"
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def train_in_turn(nproc: int, jobs: list[dict], work: Path) -> subprocess.Popen:
    """``jobs`` (tests/train_in_turn.py: `vitgraph train` arguments, optionally a resume from
    another job's checkpoint) one after another in one torchrun launch of ``nproc``, started."""
    work.mkdir(parents=True, exist_ok=True)
    spec = work / "jobs.json"
    spec.write_text(json.dumps(jobs))
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                             str(nproc), "--master-addr", "127.0.0.1", "--master-port",
                             str(free_port()), str(ROOT / "tests" / "train_in_turn.py"),
                             str(spec)], env=dict(clean_env(), OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class Launches:
    """The training runs of every collected module that defines ``launch_jobs(root)`` (world
    size -> [(name, train_in_turn job)], run folders under ``root``): one torchrun launch per
    world size for all modules' jobs, a launch's start-up (the interpreters, torch,
    megatron-core: ~9 s of CPU per rank) paid once per world size in the session. The
    launches run one after another (world 1 first: later jobs resume or distil from its runs)
    in a thread, from the session's start, while the tests that need none of them run in this
    process (one thread: the other core is theirs). A module's launched jobs need one of its
    collected tests marked multiproc."""

    def __init__(self, items, tmp_path_factory, timeout: int = 1500):
        import train_in_turn as turn
        items = [i for i in items  # the modules of the selected tests that read them
                 if hasattr(i.module, "launch_jobs") and "launched" in i.fixturenames]
        modules = sorted({i.module for i in items}, key=lambda m: m.__name__)
        multiproc = {i.module for i in items if "multiproc" in i.keywords}  # -m "not multiproc"
        self.by_world: dict[int, list] = {}
        for module in modules:
            root = tmp_path_factory.mktemp(module.__name__)
            for world, jobs in module.launch_jobs(root).items():
                if world == 1 or module in multiproc:
                    self.by_world.setdefault(world, []).extend(
                        (module.__name__, n, j) for n, j in jobs)
        self.runs: dict[str, dict[str, tuple]] = {m.__name__: {} for m in modules}
        self.run_dir, self.factory, self.timeout = turn.run_dir, tmp_path_factory, timeout
        self.proc, self.stopped, self.zero_filled = None, False, []
        self.thread = threading.Thread(target=self._launch, daemon=True)
        self.thread.start()

    def _launch(self):
        for world, jobs in sorted(self.by_world.items()):
            if self.stopped:
                return
            self.proc = train_in_turn(world, [job for _, _, job in jobs],
                                      self.factory.mktemp(f"world{world}"))
            try:
                out, err = self.proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out, err = self.proc.communicate()
                err += f"\nthe launch ran past {self.timeout} s and was killed"
            launch = subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)
            self.zero_filled += [(world, line) for line in (out + err).splitlines()
                                 if ZERO_FILLED in line]
            for module, name, job in jobs:
                self.runs[module][name] = (self.run_dir(job), launch)

    def result(self) -> dict[str, dict[str, tuple]]:
        """module name -> job name -> (run folder, launch), once every launch has ended."""
        self.thread.join()
        if self.zero_filled:
            world, line = self.zero_filled[0]
            pytest.fail(f"megatron's distributed optimizer zero-filled checkpoint state in the "
                        f"launch of {world}: {line}")
        return self.runs

    def stop(self):
        self.stopped = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        self.thread.join()


@pytest.fixture(scope="session", autouse=True)
def launches(request, tmp_path_factory):
    ls = Launches(request.session.items, tmp_path_factory)
    yield ls
    ls.stop()


@pytest.fixture(scope="session")
def launched(launches) -> dict[str, dict[str, tuple]]:
    """module name -> job name -> (run folder, launch): ``Launches``' runs."""
    return launches.result()


def launch_output(launch: subprocess.CompletedProcess) -> str:
    return f" (launch exit {launch.returncode}):\n{launch.stdout[-3000:]}\n{launch.stderr[-5000:]}"


def write_result(out: str, name: str, check, *args) -> None:
    """For a call job (tests/train_in_turn.py): run ``check(*args)`` on this rank and write
    ``out/name``: "ok", or the traceback of its failed assertion (the other checks of the
    launch still run; their collectives come before their assertions)."""
    import traceback
    try:
        check(*args)
        result = "ok"
    except AssertionError:
        result = traceback.format_exc()
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / name).write_text(result)


def assert_results(out: Path, launch: subprocess.CompletedProcess, names: list[str]) -> None:
    """What write_result wrote under ``out``: each of ``names`` there and "ok"."""
    for name in names:
        f = Path(out) / name
        if not f.is_file():
            pytest.fail(f"{f} was not written{launch_output(launch)}")
        assert f.read_text() == "ok", f.read_text()


def loss_records(run_dir: Path, launch: subprocess.CompletedProcess | None = None) -> list[dict]:
    """The training records of a run's log.jsonl; a missing log fails the test with the
    output of the launch that should have written it (or the run's train.log)."""
    log = Path(run_dir) / "log.jsonl"
    if not log.is_file():
        if launch is not None:
            detail = launch_output(launch)
        elif (Path(run_dir) / "train.log").is_file():
            detail = ":\n" + (Path(run_dir) / "train.log").read_text()[-5000:]
        else:
            detail = ""
        pytest.fail(f"{log} was not written{detail}")
    return [r for r in map(json.loads, log.read_text().splitlines()) if "loss" in r]


@pytest.fixture
def env():
    return clean_env()


def training_state(t) -> dict:
    """Everything a Trainer ``t`` holds that a checkpoint must give back, copied, by name: the
    model's weights (bf16 on GPU), each optimizer part's fp32 weights (megatron's main params,
    the distributed optimizer's shards; the parameters themselves on CPU), its Adam moments,
    step counts and param groups (through the inner optimizer's state_dict, so TE's layout on
    GPU), the EMA and its count, the LR schedule, the data position, the RNG state and the
    step."""
    def copy(v):  # parallel.fsdp: this rank's piece
        return local(v).detach().clone() if torch.is_tensor(v) else v

    out = {"step": t.step, "scheduler": t.scheduler.state_dict(),
           "loader": t.loader.state_dict(), "rng.torch": torch.get_rng_state()}
    for i, c in enumerate(t.chunks):
        out.update({f"model{i}.{n}": copy(p) for n, p in c.named_parameters()})
    for j, part in enumerate(getattr(t.optimizer, "chained_optimizers", None) or [t.optimizer]):
        inner = part.optimizer
        sd = inner.state_dict()
        for g, (saved, live) in enumerate(zip(sd["param_groups"], inner.param_groups)):
            pre = f"optimizer{j}.group{g}"
            out.update({f"{pre}.{k}": copy(v) for k, v in saved.items() if k != "params"})
            for i, (index, p) in enumerate(zip(saved["params"], live["params"])):
                out[f"{pre}.{i}.main"] = copy(p)
                state = sd["state"].get(index, {})
                out.update({f"{pre}.{i}.{k}": copy(v) for k, v in state.items()})
    if t.ema is not None:
        out["ema.count"] = copy(t.ema.count)
        out.update({f"ema.{i}": copy(e.ema) for i, e in enumerate(t.ema.entries)})
    if t.d.cuda:
        from megatron.core import tensor_parallel
        out["rng.cuda"] = torch.cuda.get_rng_state()
        # under CUDA graphs megatron's tracker keeps graph-safe generators: their states
        out["rng.tracker"] = {k: v.get_state() if isinstance(v, torch.Generator) else v for k, v
                              in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    return out


def save_then_load(make, steps: int = 3, shutdown_dist: bool = True) -> tuple[dict, dict]:
    """A Trainer from ``make()`` trains ``steps`` steps and saves a checkpoint; a second one
    from ``make()`` (the same run folder) resumes from it. (training_state after the save,
    training_state after the load). ``shutdown_dist=False``: both in one default process
    group, as tests and benchmarks make trainers."""
    t = make()
    try:
        for _ in range(steps):
            t.graphs.step_begin(t.step)
            t.train_step(t.loader.next_step(), None)
            t.step += 1
        t.checkpointer.save(t.step)
        saved = training_state(t)
    finally:
        t.close(shutdown_dist=shutdown_dist)
    t = make()
    try:
        t.maybe_resume()
        return saved, training_state(t)
    finally:
        t.close()


def assert_same_state(got: dict, want: dict) -> None:
    """``got`` and ``want`` (training_state) hold the same names and, bit for bit, the same
    values: tensors of the same dtype, shape and bytes, everything else equal."""
    def same(a, b) -> bool:
        if torch.is_tensor(a) or torch.is_tensor(b):
            return (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype
                    and a.shape == b.shape and a.device == b.device
                    and torch.equal(a.reshape(-1).view(torch.uint8),
                                    b.reshape(-1).view(torch.uint8)))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return type(a) is type(b) and a == b

    assert sorted(got) == sorted(want), set(got) ^ set(want)
    wrong = [k for k in want if not same(got[k], want[k])]
    assert not wrong, f"{len(wrong)} of {len(want)} differ after the load: {wrong[:8]}"


# megatron-core's distributed optimizer, building a checkpoint, cut a parameter's state past
# its buffer's end and zero-filled it with this warning (vitgraph.train.optim:
# checkpoint_state_at_parameter_offsets); every test fails where it is logged: in this process
# (no_zero_filled_optimizer_state), in the output of the session's launches (Launches)
ZERO_FILLED = "param range exceeds unpadded buffer"


class _ZeroFilled(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        if ZERO_FILLED in record.getMessage():
            self.messages.append(record.getMessage())


@contextlib.contextmanager
def zero_filled_warnings():
    """The messages megatron's distributed optimizer logs inside the block that say it
    zero-filled a parameter's checkpoint state (a list, filled as they come)."""
    handler = _ZeroFilled()
    logger = logging.getLogger("megatron.core.optimizer.distrib_optimizer")
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


@pytest.fixture(autouse=True)
def no_zero_filled_optimizer_state():
    with zero_filled_warnings() as messages:
        yield
    if messages:
        pytest.fail(f"megatron's distributed optimizer zero-filled checkpoint state: {messages[0]}")


def checkpoint_tensors(step_dir) -> dict:
    """Every tensor of a checkpoint (model and optimizer state) by its global key, read in
    this process without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    reader = dcp.FileSystemReader(str(step_dir / "dist"))
    meta = reader.read_metadata().state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
           if isinstance(m, TensorStorageMetadata)}
    dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def assert_graphed_step_equals_eager(eager, graphed, loss_of) -> None:
    """One step: ``loss_of(model)``'s loss and the parameters' gradients of ``graphed`` are
    ``eager``'s, bit for bit (the CPU rerun backend replays the same kernels)."""
    losses = []
    for model in (eager, graphed):
        model.zero_grad()
        loss = loss_of(model)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    for (name, a), b in zip(eager.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)


def world_of_one(spec: str):
    """A module-scoped fixture: this process as a world of one (gloo on CPU, NCCL on GPU)."""
    @pytest.fixture(scope="module")
    def fixture():
        from vitgraph.config import load_config
        from vitgraph.parallel.setup import init_distributed, shutdown
        from vitgraph.plan import resolve
        cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", [f"model.spec={spec}"])
        d = init_distributed(resolve(cfg, 1))
        yield d
        shutdown()
    return fixture


def import_open_clip():
    """``import open_clip`` (the test extra); skips the test where the package is not
    installed."""
    return pytest.importorskip("open_clip", reason="open_clip_torch is not installed "
                                                   "(pip install -e .[test])")


def write_hf_tokenizer(folder: Path, texts: list[str], **special) -> Path:
    """A small byte-level BPE ``PreTrainedTokenizerFast`` trained on ``texts`` and saved to
    ``folder`` (``save_pretrained``): a transformers tokenizer made offline. ``special``:
    its bos_token / eos_token / pad_token ..., each also a special token of its vocabulary."""
    pytest.importorskip("transformers", reason="transformers is not installed "
                                               "(pip install -e .[test])")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=sorted(set(special.values())), show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(folder)
    return folder


def normalise_patches(patches: torch.Tensor, device, dtype=torch.float32) -> torch.Tensor:
    """uint8 patch rows [T, 3 p^2] ((c, y, x) order) normalised as the fixed path's images
    ((v / 255 - mean) / std per channel) on ``device``: the reference the packed inputs are
    held against."""
    x = patches.to(device, non_blocking=True).float().div_(255.0)
    per = x.shape[-1] // 3
    mean = torch.tensor(MEAN, device=x.device).repeat_interleave(per)
    std = torch.tensor(STD, device=x.device).repeat_interleave(per)
    return ((x - mean) / std).to(dtype)
