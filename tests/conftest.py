import os
import socket
import sys
from pathlib import Path

import pytest

from vitgraph import set_hardware_queues

set_hardware_queues()  # in-process GPU tests run as `vitgraph train` does (before CUDA starts)
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the H200: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@pytest.fixture
def env():
    return clean_env()


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


def world_of_one(spec: str):
    """A module-scoped fixture: this process as a world of one (gloo on CPU, NCCL on GPU)."""
    @pytest.fixture(scope="module")
    def fixture():
        from vitgraph.config import load_config
        from vitgraph.parallel.setup import init_distributed, shutdown
        cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", [f"model.spec={spec}"])
        d = init_distributed(cfg)
        yield d
        shutdown()
    return fixture


def import_timm():
    """``import timm`` on a CPU-only torch (see ``import_without_torchvision``)."""
    return import_without_torchvision("timm")


def import_open_clip():
    """``import open_clip`` (the test extra) on a CPU-only torch; skips the test where the
    package is not installed. Its model code (ViTs, text towers) uses no torchvision."""
    import importlib.util
    if importlib.util.find_spec("open_clip") is None:
        pytest.skip("open_clip_torch is not installed (pip install -e .[test])")
    return import_without_torchvision("open_clip")


def import_without_torchvision(name: str):
    """``import name`` for packages that import torchvision at import time (timm, open_clip).

    PyPI has no CPU build of torchvision for Linux: its wheel needs CUDA torch's libraries.
    When torchvision cannot be imported, the package is imported with a stand-in for it (a
    module whose every attribute is a MagicMock), and the stand-in is taken out of
    ``sys.modules`` again afterwards so that nothing else (e.g. transformers) mistakes it for
    torchvision. Only model code that uses no torchvision may be used from such an import.
    """
    import importlib
    try:
        import torchvision  # noqa: F401
        return importlib.import_module(name)
    except Exception:
        pass
    import importlib.abc
    import importlib.machinery
    from unittest import mock

    class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name == "torchvision" or name.startswith("torchvision."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            m = mock.MagicMock(name=spec.name)
            m.__path__, m.__spec__, m.__name__ = [], spec, spec.name
            return m

        def exec_module(self, module):
            pass

    finder = _StandIn()
    for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
        del sys.modules[k]
    sys.meta_path.insert(0, finder)
    try:
        module = importlib.import_module(name)
    finally:
        sys.meta_path.remove(finder)
        for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[k]
    return module
