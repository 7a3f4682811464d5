"""Scoring rewards in worker processes, each sample under a timeout.

Why not score on the driver: the verifiers of real math tasks call sympy (through Math-Verify),
which can take seconds, or forever, on an adversarial response such as ``\\boxed{9^{9^{9^{9}}}}``,
and a user's ``reward.function`` may do anything. On the driver of a torch.distributed job one
hang stalls every rank until the collective timeout kills the run. So :class:`Rewarder` scores
in a small pool of processes it can kill:

- **spawn, not fork.** The driver is a multi-threaded torch.distributed process; a forked child
  inherits locks held by threads that do not exist in it (a classic deadlock). Spawned workers
  start a fresh interpreter and import only this package's reward code (no torch, see
  ``reward/text.py``) plus the task's ``WORKER_PRELOADS``.
- **One task per worker at a time, over its own pipe.** The parent knows which task each worker is
  on and since when, so a timeout is exact and counts only time spent on the task (not queueing,
  not a worker's start-up). A task is one sample for a task verifier, and one contiguous chunk
  per worker for a user batch function; its deadline is ``timeout_s`` times its sample count.
- **Past the deadline the worker is killed** (SIGKILL: a sympy call deep in C cannot be interrupted
  any other way) and a fresh one is started; the task's samples score 0 and are counted in
  ``reward/timeouts``. Later batches run on the replacement.
- **A verifier that raises** (or a worker that dies) scores its samples 0 and counts them in
  ``reward/errors``; the first message is kept in :attr:`Rewarder.last_error` and printed once
  per call. The run goes on: a reward bug must not lose a multi-day job.
- **No leaked processes.** Workers are daemons (multiprocessing terminates them when the parent
  exits normally); :meth:`Rewarder.close` kills them, and so does a finalizer if a Rewarder is
  dropped unclosed. A worker also exits by itself when its parent process dies, even by SIGKILL:
  it sees its pipe close while idle, and a watchdog thread sees its parent pid change while busy.
- **Signals for the trainer are not for the workers.** SIGINT (Ctrl-C) and SIGUSR1 (preemption,
  which torchrun forwards to the rank's whole process group) are ignored by workers, so the step
  a preempted trainer finishes before its checkpoint is scored like any other.

``reward.num_workers = 0`` scores in the calling process with the same rewards and error
counting but no timeout; that is for tests and tiny CPU runs with the arithmetic task.
Because workers are started with spawn, verifiers and user functions must be importable in a
fresh process: top-level functions in importable modules, not lambdas or ``__main__`` code.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from megatron_rl_fp8.metrics.logger import print_rank0
from megatron_rl_fp8.reward.verifiers import RewardConfig, ScoreJob, make_score_job

if TYPE_CHECKING:
    import torch

# Workers import the package's reward code (and e.g. sympy) before taking work; on a loaded
# machine with several workers starting at once this takes seconds, rarely more.
_START_TIMEOUT_S = 300.0
# A watchdog thread in each worker checks this often whether its parent is still alive.
_PARENT_POLL_S = 1.0
_MAX_ERROR_CHARS = 500
# Signals meant for the trainer that also reach its workers: a worker ignores them.
_PARENT_SIGNALS = (signal.SIGINT, signal.SIGUSR1)

Task = tuple[int, tuple]
"""``(number of samples, args of ScoreJob.__call__)``: the unit a worker scores and times."""


def _describe(exc: BaseException) -> str:
    """``"ValueError: message"`` on one line, capped (a message may embed a whole response)."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


# ---------------------------------------------------------------------------------------------
# The worker process
# ---------------------------------------------------------------------------------------------


def _exit_with_parent(parent_pid: int) -> None:
    # Once the parent dies the worker is re-parented, so getppid() changes. os._exit: the main
    # thread may be stuck in a verifier, and nothing of the worker's needs cleaning up.
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def _worker_main(conn: Connection, job_bytes: bytes, parent_pid: int) -> None:
    """One worker: receive ``(task_id, args)``, reply ``("ok"|"error", task_id, payload)``."""
    # Ctrl-C in a terminal, and SIGUSR1 from torchrun (it signals the rank's process group) or
    # from slurmstepd (every process of the step), reach the workers too; the parent decides what
    # happens, and a preempted step still needs its rewards. The parent blocked both around the
    # spawn, so none arrived before this point.
    for sig in _PARENT_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _PARENT_SIGNALS)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        job: ScoreJob = pickle.loads(job_bytes)
        job.prepare()
    except BaseException as e:  # reported to the parent, which raises
        conn.send(("init_error", _describe(e)))
        return
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed the pipe, or died
        if message is None:
            return
        task_id, args = message
        try:
            reply = ("ok", task_id, job(*args))
        except Exception as e:
            reply = ("error", task_id, _describe(e))
        conn.send(reply)


# ---------------------------------------------------------------------------------------------
# The pool, on the driver
# ---------------------------------------------------------------------------------------------


@dataclass
class _Worker:
    """One worker process and what the parent knows about it."""

    process: Any  # multiprocessing.context.SpawnProcess
    conn: Connection
    started_at: float
    ready: bool = False
    task: int | None = None
    deadline: float = math.inf


def _kill(worker: _Worker) -> None:
    try:
        worker.conn.close()
    except OSError:
        pass  # already closed: the worker died or close() ran twice
    if worker.process.is_alive():
        worker.process.kill()
    worker.process.join(timeout=10)


def _kill_all(workers: list[_Worker]) -> None:
    for w in workers:
        _kill(w)


@dataclass(frozen=True)
class PoolRole:
    """Who a :class:`WorkerPool` works for, as its processes and errors name it."""

    name: str = "reward"
    """The workers' process name is ``<name>-worker``; errors say "a <name> worker"."""
    functions: str = "verifiers and reward.function"
    """What must import in a fresh process (the error's subject)."""
    in_process: str = "reward.num_workers=0 to score in-process"
    """The setting that runs the job in the calling process instead."""


class WorkerPool:
    """``num_workers`` spawned processes running one job, each task on a deadline.

    A job is picklable, has ``prepare()`` (slow imports, run before the worker reports ready)
    and is called with a task's arguments; :class:`ScoreJob` is the rewards', the rollout's tool
    calls have their own (``rollout/tools.py``)."""

    def __init__(
        self,
        job: Any,
        num_workers: int,
        *,
        start_timeout_s: float = _START_TIMEOUT_S,
        role: PoolRole = PoolRole(),
    ):
        self.role = role
        try:
            self._job_bytes = pickle.dumps(job)
        except Exception as e:
            raise ValueError(
                f"the {role.functions} cannot be sent to worker processes ({_describe(e)}); "
                "define them at the top level of an importable module (no lambda or nested "
                f"function), or set {role.in_process}"
            ) from None
        self._ctx = mp.get_context("spawn")
        self._start_timeout_s = start_timeout_s
        self.restarts = 0
        self._workers: list[_Worker] = []
        # Kills the workers if the pool is garbage-collected or the interpreter exits unclosed.
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)
        try:
            for _ in range(num_workers):
                self._workers.append(self._spawn())
            while not all(w.ready for w in self._workers):
                self._receive(self._workers, timeout=1.0, outcomes=None)
        except BaseException:
            self.close()
            raise

    def _spawn(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_worker_main,
            args=(child_conn, self._job_bytes, os.getpid()),
            name=f"{self.role.name}-worker",
            daemon=True,
        )
        # The child inherits the signal mask through exec: blocked until it ignores them.
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, _PARENT_SIGNALS)
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        child_conn.close()  # the parent keeps one end, so it sees EOF when the worker dies
        return _Worker(process, parent_conn, started_at=time.monotonic())

    def _replace(self, worker: _Worker) -> None:
        """Kill ``worker`` and put a fresh process in its place (same list slot)."""
        _kill(worker)
        fresh = self._spawn()
        worker.process, worker.conn, worker.started_at = fresh.process, fresh.conn, fresh.started_at
        worker.ready, worker.task, worker.deadline = False, None, math.inf
        self.restarts += 1

    def _start_failed(self, worker: _Worker, why: str) -> RuntimeError:
        return RuntimeError(
            f"a {self.role.name} worker failed to start ({why}); {self.role.functions} must "
            "import in a fresh Python process (top-level functions in importable modules), or "
            f"set {self.role.in_process}"
        )

    def _receive(self, workers: list[_Worker], timeout: float, outcomes: dict | None) -> None:
        """Wait up to ``timeout`` s for messages from ``workers`` and apply them.

        ``outcomes`` maps task id -> ``("ok", scores)`` or ``("error", message)``; a worker that
        dies mid-task records an error for that task and is replaced.
        """
        by_conn = {w.conn: w for w in workers}
        for conn in wait(list(by_conn), timeout=timeout):
            w = by_conn[conn]
            try:
                message = conn.recv()
            except (EOFError, OSError):
                w.process.join(timeout=10)
                code = w.process.exitcode
                if not w.ready:
                    raise self._start_failed(w, f"it exited with code {code}") from None
                if w.task is not None and outcomes is not None:
                    outcomes[w.task] = ("error", f"{self.role.name} worker died (exit code {code})")
                self._replace(w)
                continue
            kind = message[0]
            if kind == "ready":
                w.ready = True
            elif kind == "init_error":
                raise self._start_failed(w, message[1])
            elif outcomes is not None and message[1] == w.task:
                outcomes[w.task] = (kind, message[2])
                w.task, w.deadline = None, math.inf
        now = time.monotonic()
        for w in workers:
            if not w.ready and now - w.started_at > self._start_timeout_s:
                raise self._start_failed(w, f"not ready after {self._start_timeout_s:.0f} s")

    def run(self, tasks: Sequence[Task], timeout_per_sample_s: float) -> dict[int, tuple]:
        """Run every task; task id -> ``("ok", scores)``, ``("error", msg)`` or ``("timeout",)``."""
        outcomes: dict[int, tuple] = {}
        pending = deque(range(len(tasks)))
        try:
            while pending or any(w.task is not None for w in self._workers):
                for w in self._workers:
                    if w.ready and w.task is None and pending:
                        task_id = pending.popleft()
                        try:
                            w.conn.send((task_id, tasks[task_id][1]))
                        except (OSError, ValueError):  # died while idle: retry on a fresh one
                            pending.appendleft(task_id)
                            self._replace(w)
                            continue
                        w.task = task_id
                        w.deadline = time.monotonic() + timeout_per_sample_s * tasks[task_id][0]
                busy = [w.deadline for w in self._workers if w.task is not None]
                wait_s = max(0.0, min(busy) - time.monotonic()) if busy else 1.0
                self._receive(self._workers, timeout=wait_s, outcomes=outcomes)
                now = time.monotonic()
                for w in self._workers:
                    if w.task is not None and now >= w.deadline:
                        outcomes[w.task] = ("timeout",)
                        self._replace(w)
        except BaseException:
            # Interrupted mid-call: busy workers hold tasks whose results nobody will read, and
            # would hand them to the next call. Replace them so the pool stays consistent.
            for w in self._workers:
                if w.task is not None:
                    self._replace(w)
            raise
        return outcomes

    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def close(self) -> None:
        self._finalizer()


def run_in_process(job: Any, tasks: Sequence[Task]) -> dict[int, tuple]:
    outcomes = {}
    for task_id, (_, args) in enumerate(tasks):
        try:
            outcomes[task_id] = ("ok", job(*args))
        except Exception as e:
            outcomes[task_id] = ("error", _describe(e))
    return outcomes


# ---------------------------------------------------------------------------------------------
# The trainer's interface
# ---------------------------------------------------------------------------------------------


class Rewarder:
    """Scores batches of responses for one task; owns the worker pool (call :meth:`close`).

    Create it once on the driver (workers take a few seconds to start) and reuse it every step::

        rewarder = Rewarder(cfg.task.name, cfg.reward)
        try:
            rewards, stats = rewarder.score(texts, answers, records)
        finally:
            rewarder.close()
    """

    def __init__(self, task_name: str, cfg: RewardConfig):
        self.task_name = task_name
        self.cfg = cfg
        self.job = make_score_job(task_name, format_weight=cfg.format_weight, function=cfg.function)
        self.last_error: str | None = None
        """The first error message of the latest :meth:`score` call (None if nothing raised)."""
        self._pool = WorkerPool(self.job, cfg.num_workers) if cfg.num_workers > 0 else None
        self._closed = False

    def _tasks(self, responses: list, answers: list, records: list) -> list[Task]:
        n = len(responses)
        if self.job.function is None:
            # One sample per task: a hang or an error costs exactly one sample.
            return [(1, ([responses[i]], [answers[i]], ())) for i in range(n)]
        # A batch function: one contiguous chunk per worker (near-equal sizes).
        n_chunks = max(1, min(self.cfg.num_workers, n))
        base, extra = divmod(n, n_chunks)
        tasks, start = [], 0
        for c in range(n_chunks):
            stop = start + base + (c < extra)
            chunk = (responses[start:stop], answers[start:stop], records[start:stop])
            tasks.append((stop - start, chunk))
            start = stop
        return tasks

    def score(
        self,
        responses: list[str],
        answers: list[str],
        records: list[dict] | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Rewards, float32 ``[len(responses)]``, and stats of this call.

        ``reward_i = correct_i + format_weight * well_formed_i``. ``records`` are the dataset
        records of each response's prompt (repeated per sample); only ``reward.function`` sees
        them. Stats: ``reward/timeouts`` and ``reward/errors`` (samples scored 0 for that reason
        in this call) and ``perf/reward_time_s``.
        """
        # lazy: the spawned scoring workers import this module and must start without torch
        import torch

        if self._closed:
            raise RuntimeError("Rewarder.score called after close(); create a new Rewarder")
        n = len(responses)
        if len(answers) != n or (records is not None and len(records) != n):
            got = f"{len(answers)} answers" + (
                "" if records is None else f", {len(records)} records"
            )
            raise ValueError(
                f"Rewarder.score got {n} responses but {got}; pass one per response (repeat each "
                "prompt's answer and record for its group)"
            )
        t0 = time.perf_counter()
        responses, answers = list(responses), list(answers)
        records = [{} for _ in range(n)] if records is None else list(records)
        tasks = self._tasks(responses, answers, records) if n else []
        if self._pool is not None and tasks:
            outcomes = self._pool.run(tasks, self.cfg.timeout_s)
        else:
            outcomes = run_in_process(self.job, tasks)
        rewards: list[float] = []
        timeouts = errors = 0
        self.last_error = None
        for task_id, (size, _) in enumerate(tasks):
            kind, *payload = outcomes[task_id]
            if kind == "ok":
                rewards += payload[0]
                continue
            rewards += [0.0] * size
            if kind == "timeout":
                timeouts += size
            else:
                errors += size
                self.last_error = self.last_error or payload[0]
        if self.last_error is not None:
            print_rank0(
                f"reward: {errors} sample(s) of task {self.task_name!r} raised and scored 0; "
                f"first error: {self.last_error}"
            )
        stats = {
            "reward/timeouts": float(timeouts),
            "reward/errors": float(errors),
            "perf/reward_time_s": time.perf_counter() - t0,
        }
        return torch.tensor(rewards, dtype=torch.float32), stats

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (empty when scoring in-process)."""
        return [] if self._pool is None else self._pool.pids()

    def close(self) -> None:
        """Kill the worker processes. Idempotent; :meth:`score` must not be called after."""
        self._closed = True
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> Rewarder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
