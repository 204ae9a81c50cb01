"""The block copy worker's jobs and its completion queues (one per kind of transfer).

Runs in: GPU worker processes, inside :class:`shmtier.gpu.copy_worker.BlockCopyWorker`,
which plans each job (its :class:`RefCopy` pieces) and hands it with the function
that copies it to a queue. A queue runs its jobs in submission order and reports
them finished in that order:

* :class:`ThreadQueue` (CPU tensors): one daemon thread per queue (or inline, for
  tests), so a store never waits behind a load;
* :class:`CudaQueue` (CUDA tensors): one CUDA stream per queue that first waits on
  the submitting thread's current stream; events give completion and timing.

A job whose copy raises (in the queue thread; for CUDA at launch, or when its
event reports an error while polled or waited on) is kept in its place and
reported by ``get_finished`` as ``TransferResult(job_id, False, 0, elapsed)``;
``get_finished`` and ``wait`` never raise for a failed copy. vLLM 0.34's
connector turns a failed async load into a failed receive and raises for a
failed sync load; 0.32/0.33's connector asserts success.

Shared bytes: none of their own; the copy functions touch the arena and the KV tensors.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from shmtier.contract import TransferResult

logger = logging.getLogger("shmtier.gpu.copy_worker")  # failed jobs log as the worker's


def clear_cuda_error() -> None:
    """Reset the CUDA runtime's last-error slot after a failed call, so a later
    unrelated launch check does not report it (a sticky error stays)."""
    cudart = torch.cuda.cudart()
    fn = getattr(cudart, "cudaGetLastError", None)
    if fn is not None:
        fn()
        return
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        pass


@dataclass
class RefCopy:
    """One ref's share of a job: block ``gpu_blocks[k]`` of tensor
    ``tensor_idx`` <-> ``nbytes`` bytes at arena byte offset ``cpu_offsets[k]``."""

    tensor_idx: int
    nbytes: int
    gpu_blocks: np.ndarray  # int64
    cpu_offsets: np.ndarray  # int64, absolute within the arena


class Job:
    __slots__ = ("job_id", "copies", "nbytes", "done", "elapsed", "error",
                 "start_event", "end_event", "keepalive")

    def __init__(self, job_id: int, copies: list[RefCopy], nbytes: int):
        self.job_id = job_id
        self.copies = copies
        self.nbytes = nbytes
        self.done = False
        self.elapsed = 0.0
        self.error: BaseException | None = None
        self.start_event = None
        self.end_event = None
        self.keepalive: list[Any] | None = None

    def result(self) -> TransferResult:
        if self.error is not None:
            return TransferResult(self.job_id, False, 0, self.elapsed)
        return TransferResult(self.job_id, True, self.nbytes, self.elapsed)


class ThreadQueue:
    """FIFO queue of CPU copy jobs run by one daemon thread (or inline).

    ``execute(job)`` performs the copies; it runs on the queue's thread.
    """

    def __init__(self, name: str, execute: Callable[[Job], None], threaded: bool):
        self.name = name
        self._execute = execute
        self._threaded = threaded
        self._pending: deque[Job] = deque()  # submitted, not yet reported
        self._todo: deque[Job] = deque()  # not yet started
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def submit(self, job: Job) -> None:
        if not self._threaded:
            self._pending.append(job)
            self._run(job)
            return
        with self._cv:
            if self._stopping:
                raise RuntimeError(f"copy queue {self.name} is shut down")
            self._pending.append(job)
            self._todo.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"shmtier-copy-{self.name}", daemon=True
                )
                self._thread.start()
            self._cv.notify()

    def _run(self, job: Job) -> None:
        start = time.perf_counter()
        try:
            self._execute(job)
        except BaseException as exc:  # noqa: BLE001 - reported as a failed job
            job.error = exc
            logger.exception("copy job %d on queue %s failed", job.job_id, self.name)
        job.elapsed = time.perf_counter() - start
        job.copies = None
        with self._cv:
            job.done = True
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._todo and not self._stopping:
                    self._cv.wait()
                if not self._todo:
                    return  # stopping and drained
                job = self._todo.popleft()
            self._run(job)

    def get_finished(self) -> list[TransferResult]:
        results = []
        with self._cv:
            while self._pending and self._pending[0].done:
                results.append(self._pending.popleft().result())
        return results

    def wait(self, job_ids: set[int]) -> None:
        with self._cv:
            jobs = [job for job in self._pending if job.job_id in job_ids]
            self._cv.wait_for(lambda: all(job.done for job in jobs))

    def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._cv:
            self._pending.clear()


class CudaQueue:
    """FIFO queue of copy jobs issued on one CUDA stream; events mark completion.

    A job whose launch fails is still reported in order, once its end event
    (recorded after the failure) completes; a job whose event raises while
    polled or waited on, or could not be recorded, is reported failed at once.
    Events of failed jobs are not reused.
    """

    def __init__(self, name: str, execute: Callable[[Job], list[Any]], device: torch.device):
        self.name = name
        self._execute = execute
        self._device = device
        self._stream = torch.cuda.Stream(device=device)
        self._pending: deque[Job] = deque()
        self._events: list[Any] = []  # recycled timing events

    def _event(self):
        return self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)

    def _fail(self, job: Job, exc: BaseException, when: str) -> None:
        job.error = exc
        if isinstance(exc, RuntimeError):  # torch's CUDA errors
            clear_cuda_error()
        logger.error("copy job %d on queue %s failed %s: %s", job.job_id, self.name, when, exc,
                     exc_info=exc)

    def submit(self, job: Job) -> None:
        stream = self._stream
        job.start_event, job.end_event = self._event(), self._event()
        recorded = False
        try:
            # Stores must read finished KV; loads must land after the zeroing of
            # their destination blocks: both were queued on the current stream.
            stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(stream):
                job.start_event.record(stream)
                try:
                    job.keepalive = self._execute(job)
                finally:
                    job.end_event.record(stream)
                    recorded = True
        except Exception as exc:  # noqa: BLE001 - reported as a failed job
            self._fail(job, exc, "at launch")
            if not recorded:
                job.end_event = None  # nothing to wait for
        job.copies = None
        self._pending.append(job)

    def get_finished(self) -> list[TransferResult]:
        results = []
        while self._pending:
            job = self._pending[0]
            if job.end_event is not None:
                try:
                    if not job.end_event.query():
                        break
                    if job.error is None:
                        job.elapsed = job.start_event.elapsed_time(job.end_event) * 1e-3
                except RuntimeError as exc:
                    self._fail(job, exc, "while polled for completion")
            self._pending.popleft()
            if job.error is None:
                self._events += (job.start_event, job.end_event)
            job.keepalive = None
            results.append(job.result())
        return results

    def wait(self, job_ids: set[int]) -> None:
        for job in list(self._pending):
            if job.job_id in job_ids and job.end_event is not None:
                try:
                    job.end_event.synchronize()
                except RuntimeError as exc:
                    self._fail(job, exc, "while waited on")
                    job.end_event = None  # reported failed by get_finished

    def shutdown(self) -> None:
        try:
            for job in self._pending:
                if job.end_event is not None:
                    job.end_event.synchronize()
        finally:
            self._pending.clear()
            self._events.clear()
