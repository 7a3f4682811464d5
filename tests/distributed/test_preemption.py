"""The preemption signal: caught as a flag, seen by every rank at the step's end, handler restored.
(The whole path -- Slurm's signal, checkpoint, exit code, requeue, resume -- runs on a real Slurm in
tests/slurm.)"""

import os
import signal

import torch

from megatron_rl_fp8.trainer.preemption import PreemptionSignal
from tests.dist_utils import run_distributed


def test_signal_sets_the_flag_and_close_restores_the_handler():
    before = signal.getsignal(signal.SIGUSR1)
    pre = PreemptionSignal(torch.device("cpu"))
    try:
        assert not pre.requested()
        os.kill(os.getpid(), signal.SIGUSR1)  # handled in the main thread before kill returns
        assert pre.received and pre.requested()
    finally:
        pre.close()
    assert signal.getsignal(signal.SIGUSR1) is before


def _one_rank_signalled(rank, world_size):
    pre = PreemptionSignal(torch.device("cpu"))
    try:
        first = pre.requested()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return first, pre.requested()
    finally:
        pre.close()


def test_a_signal_on_one_rank_stops_every_rank():
    assert run_distributed(_one_rank_signalled, world_size=2) == [(False, True), (False, True)]
