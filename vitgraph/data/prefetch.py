"""The next training step's microbatches, made while this step runs.

``Prefetcher`` wraps a ``MicrobatchLoader``: a background thread takes the next step from it
(reading shards and, with ``data.decode=cpu``, decoding JPEGs in the loader's threads) and, on
a GPU, puts the microbatches on the device from a side CUDA stream: pinned host-to-device
copies, and nvJPEG decode for ``data.decode=cuda`` shards. Without it that work sat between
steps: ViT-B/16 from JPEG shards trained at 0.55x its in-memory step rate on an H200
(benchmarks/BENCHMARKS.md, fourth session), and pageable copies block the host.

Order and content are the loader's alone (it is deterministic), so prefetching changes no
batch. The checkpointed position is the one after the last step handed out, not the one the
thread has reached: a resumed run repeats and skips nothing.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from vitgraph.data.loader import MicrobatchLoader


class Prefetcher:
    """``MicrobatchLoader``'s interface (``next_step``, ``state_dict``, ``load_state_dict``,
    ``epoch``, ``steps_per_epoch``), one step ahead. ``device``: where microbatch tensors are
    put (a CUDA device: from a side stream; otherwise they stay as the loader made them)."""

    def __init__(self, loader: MicrobatchLoader, device):
        self.loader = loader
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vitgraph-prefetch")
        self._next: Future | None = None  # started by the first next_step (after any resume)
        self._state = loader.state_dict()

    @property
    def steps_per_epoch(self) -> int:
        return self.loader.steps_per_epoch

    @property
    def epoch(self) -> int:
        return self._state["epoch"]

    def _make(self):
        batches = self.loader.next_step()
        state = self.loader.state_dict()
        if not self.cuda:
            return batches, state, None
        with torch.cuda.stream(self.stream):
            batches = [tuple(self._to_device(f) for f in mb) for mb in batches]
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return batches, state, ready

    def _to_device(self, field):
        from vitgraph.data.shards import EncodedImages, decode_on_device
        if isinstance(field, EncodedImages):
            return decode_on_device(field, self.device)
        if torch.is_tensor(field) and field.device.type == "cpu":
            return field.pin_memory().to(self.device, non_blocking=True)
        return field

    def next_step(self) -> list[tuple]:
        if self._next is None:
            self._next = self._pool.submit(self._make)
        batches, state, ready = self._next.result()  # re-raises a data error here
        self._next = self._pool.submit(self._make)
        self._state = state
        if ready is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(ready)
            for mb in batches:  # made on the side stream, used (and freed) on this one
                for f in mb:
                    if torch.is_tensor(f) and f.is_cuda:
                        f.record_stream(main)
        return batches

    def _drain(self) -> None:
        if self._next is not None:
            try:
                self._next.result()
            except Exception:  # a step that will not be used: its error does not matter
                pass
            self._next = None

    def state_dict(self) -> dict:
        return dict(self._state)

    def load_state_dict(self, sd: dict) -> None:
        self._drain()
        self.loader.load_state_dict(sd)
        self._state = self.loader.state_dict()

    def close(self) -> None:
        self._drain()
        self._pool.shutdown(wait=True)
