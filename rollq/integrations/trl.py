"""TRL's ``AsyncGRPOTrainer`` on rollq: ``rollq.consumers.trainer.integrations.trl``."""

from rollq.consumers.trainer.integrations.trl import (
    RollqCallback,
    RollqRolloutWorker,
    RollqWeightTransfer,
    SequenceTooLong,
)
from rollq.consumers.trainer.integrations.trl_cpu import flash_attn_varlen_torch, use_cpu_kernels

__all__ = [
    "RollqCallback",
    "RollqRolloutWorker",
    "RollqWeightTransfer",
    "SequenceTooLong",
    "flash_attn_varlen_torch",
    "use_cpu_kernels",
]
