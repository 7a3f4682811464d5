"""Slurm launches: one allocation, trainer nodes and SGLang rollout nodes (slurm/README.md).

``slurm`` reads the job (node list, GPUs, job id, node addresses), ``layout`` decides each node's
role and ports and refuses a run that cannot start, ``render`` writes each role's ``srun``
command, ``cli`` is ``megatron-rl-fp8 launch``. ``slurm/train.sbatch`` runs ``launch --dry-run``
and then the rendered commands.
"""

REQUEUE_EXIT_CODE = 42
"""The exit status by which the trainer says "checkpointed on a preemption signal: requeue me"
(``slurm/train.sbatch`` calls ``scontrol requeue`` on it). torchrun reports any failed rank as
1, so behind torchrun the script also requeues a run that failed after it forwarded SIGUSR1."""

__all__ = ["REQUEUE_EXIT_CODE"]
