"""The next training step's microbatches, made while this step runs.

``Prefetcher`` wraps a ``MicrobatchLoader`` (or a ``native.PackedLoader``). A background
thread takes the step after next from it: shard reads and, with ``data.decode=cpu`` (or
``data.cpu_decode_share``), JPEG decoding in the loader's threads, all CPU work. On a GPU the
next step is put on the device from a side CUDA stream (pinned host-to-device copies; nvJPEG
decode and the resize for ``data.decode=cuda``, a pack's patchify too) when the trainer calls
``stage_next``: once a step's forward and backward are queued and before the host waits for
them, so that this work runs beside the step's kernels rather than between steps. The CUDA
calls are made by the training thread itself, never by the background one: Transformer
Engine captures its graphs in CUDA's global capture mode, where an allocation by any other
thread would break the capture. Why there and then (ViT-B/16 from JPEG shards, mb 256, an
H200; benchmarks/BENCHMARKS.md): with all of this between steps training ran at 0.55x its
in-memory step rate; staged when a step is handed out, before its kernels are queued, 0.66x;
staged from the background thread (the nvJPEG calls there, behind a lock against graph
captures), 2,000-2,540 img/s against 2,380-2,860 from the training thread.

Order and content are the loader's alone (it is deterministic), so prefetching changes no
batch. The checkpointed position is the one after the last step handed out, not the one the
thread has reached: a resumed run repeats and skips nothing. A data error met while staging
is raised by the ``next_step`` that would have handed that step out.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from vitgraph.data.decode import EncodedPack, finish_pack_on_device, finish_step_on_device
from vitgraph.data.loader import MicrobatchLoader


class Prefetcher:
    """``MicrobatchLoader``'s interface (``next_step``, ``state_dict``, ``load_state_dict``,
    ``epoch``, ``steps_per_epoch``), made ahead. ``device``: where microbatch tensors are
    put (a CUDA device: from a side stream; otherwise they stay as the loader made them).
    ``host_fields``: fields made from a microbatch's CPU fields in the background thread and
    appended to it (the task's ``host_fields``), so that nothing reads them back from the
    device."""

    def __init__(self, loader: MicrobatchLoader, device, host_fields=None):
        self.loader = loader
        self.host_fields = host_fields
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vitgraph-prefetch")
        self._next: Future | None = None  # started by the first next_step (after any resume)
        self._staged = None  # the step next_step hands out next, on the device
        self._error: Exception | None = None  # met while staging; raised by next_step
        self._state = loader.state_dict()

    @property
    def steps_per_epoch(self) -> int:
        return self.loader.steps_per_epoch

    @property
    def epoch(self) -> int:
        return self._state["epoch"]

    def _make(self):
        """Background thread: the loader's next step, on the CPU, and its position after it."""
        batches = self.loader.next_step()
        if self.host_fields is not None:
            batches = [(*mb, *self.host_fields(mb)) for mb in batches]
        return batches, self.loader.state_dict(), getattr(self.loader, "last_counts", None)

    def _stage(self, made):
        """Training thread: a made step onto the device from the side stream (an event marks
        when it is there); on CPU as it is."""
        batches, state, counts = made
        if not self.cuda:
            return batches, (state, counts), None
        with torch.cuda.stream(self.stream):
            batches = finish_step_on_device(batches, self.device)
            batches = [tuple(self._to_device(f) for f in mb) for mb in batches]
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return batches, (state, counts), ready

    def _to_device(self, field):
        if isinstance(field, EncodedPack):  # a native-resolution pack's patches (nvJPEG)
            return finish_pack_on_device(field, self.device)
        if torch.is_tensor(field) and field.device.type == "cpu":
            return field.pin_memory().to(self.device, non_blocking=True)
        return field

    def stage_next(self) -> None:
        """Put the next step on the device now (the background thread starts on the one
        after). Called by the trainer while a step's kernels run; a data error is kept for
        ``next_step``."""
        if self._staged is not None or self._error is not None:
            return
        try:
            if self._next is None:  # the first step, or the first after a load
                self._next = self._pool.submit(self._make)
            made = self._next.result()
            self._next = self._pool.submit(self._make)
            self._staged = self._stage(made)
        except Exception as e:
            self._error = e

    def next_step(self) -> list[tuple]:
        self.stage_next()  # nothing staged yet: the first step, or no trainer called it
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        (batches, (state, counts), ready), self._staged = self._staged, None
        self._state = state
        self.last_counts = counts  # of the step handed out (PackedLoader.last_counts)
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
        self._staged = self._error = None

    def state_dict(self) -> dict:
        return dict(self._state)

    def load_state_dict(self, sd: dict) -> None:
        self._drain()
        self.loader.load_state_dict(sd)
        self._state = self.loader.state_dict()

    def close(self) -> None:
        self._drain()
        self._pool.shutdown(wait=True)
