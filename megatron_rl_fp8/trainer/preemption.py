"""Preemption and time limits: a signal asks the run to stop after the current step, with a
checkpoint, so the job can be requeued and resume where it stopped.

Slurm sends it ahead of a time limit or a preemption (``#SBATCH --signal=B:USR1@120`` reaches the
batch script, ``slurm/train.sbatch`` forwards it to the trainer's ``srun``, torchrun to every rank
with ``--signals-to-handle``); a user can send it too (``scancel --signal=USR1 --batch JOB``). The
handler only sets a flag: the step in progress finishes (its collectives must complete on every
rank), then every rank learns whether any rank was signalled (one all-reduce per step, a single
number), the trainer writes a checkpoint unless that step already wrote one, and the process
exits with ``launch.REQUEUE_EXIT_CODE``. The next run in the same output directory resumes from
that checkpoint: no metric line is lost or written twice, and the engines are synced again.
"""

from __future__ import annotations

import signal
import sys
import threading

import torch
import torch.distributed as dist

from megatron_rl_fp8.metrics.logger import print_rank0


class PreemptionSignal:
    """Catches ``signum`` (SIGUSR1) while the run trains; :meth:`requested` is collective."""

    def __init__(self, device: torch.device, signum: int = signal.SIGUSR1):
        self.device = device
        self.signum = signum
        self.received = False
        self._previous = None
        # Python runs handlers in the main thread only; a trainer driven from another thread
        # (tests) keeps the default action.
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if not self.received:
            print(
                f"[preemption] {signal.Signals(signum).name}: stopping after this step with a "
                "checkpoint",
                file=sys.stderr,
                flush=True,
            )
        self.received = True

    def requested(self) -> bool:
        """Whether any rank received the signal (collective: one all-reduce)."""
        flag = torch.tensor([float(self.received)], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def stopped(self, step: int) -> None:
        """After the checkpoint of ``step``: no rank may exit before every rank's part is on
        disk (the launcher kills the others as soon as one exits). Collective."""
        dist.barrier()
        print_rank0(
            f"preemption: stopped after step {step} with its checkpoint; a run in the same "
            "train.output_dir resumes from it"
        )

    def close(self) -> None:
        """Restore the handler that was there before."""
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None
