"""vitgraph: train vision encoders the Megatron way."""
import ctypes
import os
import signal
import time
import warnings

__version__ = "0.1.0"

# megatron-core says from five modules that Transformer Engine and Apex are missing, at import
# and again in each process that imports it (the checkpoint writer's spawned manager): ten
# lines per command. Without CUDA neither can run, and vitgraph's torch spec needs neither;
# with CUDA and no TE, vitgraph says so in one line (vitgraph.models.specs.resolve_spec).
warnings.filterwarnings("ignore", message=r"(Transformer Engine and )?Apex (is|are) not installed",
                        category=UserWarning, module="megatron")

# CUDA maps streams onto this many hardware work queues per device (CUDA's default: 8).
# nvJPEG decodes on 14 streams of its own beside the training and graph streams: with 8 queues
# most of its work ran only after the step graph, the GPU idle meanwhile (ViT-B/16 from JPEG
# shards on an H200: 0.86-0.90x the synthetic rate with 8 queues, 0.95-0.96x with 32).
HARDWARE_QUEUES = 32


def set_hardware_queues() -> str:
    """Give the process 32 hardware queues unless the user set CUDA_DEVICE_MAX_CONNECTIONS.

    The driver reads the variable once, so this must run before anything initialises CUDA
    (importing TE or megatron-core can): `vitgraph` commands, scripts/bench*.py and the
    tests call it first. Returns the value the process runs with ("8", CUDA's default, if
    it came too late)."""
    if "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ and not _driver_initialised():
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(HARDWARE_QUEUES)
    return str(hardware_queues())


def hardware_queues() -> int:
    """The CUDA_DEVICE_MAX_CONNECTIONS the process runs with: CUDA's default, 8, when it is
    unset or not a number (CUDA ignores that)."""
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "")
    return int(value) if value.isdigit() else 8


def _driver_initialised() -> bool:
    """Whether cuInit has run in this process (cuDeviceGetCount answers 3, not initialised,
    before it); False where there is no driver."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    n = ctypes.c_int()
    return cuda.cuDeviceGetCount(ctypes.byref(n)) != 3


# SIGTERM, and SIGUSR1 as SLURM's ``--signal`` sends it: stop the run, to be requeued (exit 75);
# SIGINT (Ctrl-C): the same stop, asked for by the user (exit 130, 128 + SIGINT, which
# schedulers do not requeue). docs/reliability.md
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
INTERRUPTED_EXIT = 128 + signal.SIGINT
# torchrun passes the SIGINT it gets on to its workers at once, and a terminal's Ctrl-C
# reaches them too: a SIGINT this soon after the first stop signal is that same Ctrl-C
AGAIN_AFTER_S = 1.0


class StopSignals:
    """Stop signals recorded, not acted on: ``received`` names the first one. A later SIGINT
    (a second Ctrl-C) ends the process at once, exit 130, nothing saved.

    ``vitgraph train`` installs this before its first heavy import (torch and megatron-core
    take seconds to import, during which Python's default handlers would kill the process
    with 143, or print a KeyboardInterrupt traceback); the run checks ``received`` at each
    start-up milestone and after every step (vitgraph.train.preempt)."""

    def __init__(self):
        self.received: str | None = None
        self._at = 0.0
        self._previous: dict = {}

    def install(self) -> "StopSignals":
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received, self._at = signal.Signals(signum).name, time.monotonic()
        elif signum == signal.SIGINT and time.monotonic() - self._at >= AGAIN_AFTER_S:
            # at once: no unwinding (a collective could wait on a peer); a checkpoint being
            # written stays a .tmp folder, never loaded
            os.write(2, b"vitgraph: interrupted again (SIGINT): stopped at once, nothing "
                        b"saved; the same command resumes from the newest complete "
                        b"checkpoint, if any (exit 130)\n")
            os._exit(INTERRUPTED_EXIT)

    def restore(self) -> None:
        """The handlers from before ``install``."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


# vitgraph.VisionTower and its tuples, imported when first asked for: importing them imports
# megatron-core (which can start CUDA), so the hardware queues are set first, and a plain
# `import vitgraph` (the CLI's first line) stays light
_TOWER = ("VisionTower", "PackedTokens", "Pack")


def __getattr__(name: str):
    if name in _TOWER:
        set_hardware_queues()
        from vitgraph import tower
        return getattr(tower, name)
    raise AttributeError(f"module 'vitgraph' has no attribute {name!r}")
