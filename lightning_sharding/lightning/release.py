"""``ReleaseProcessGroup``: an opt-in callback that ends the process group with the fit."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from typing_extensions import override


class ReleaseProcessGroup(pl.Callback):
    """Destroy the ``torch.distributed`` process group when fitting ends (opt-in, for scripts).

    A gloo rank that exits with its process group alive can abort in interpreter shutdown
    ("terminate called without an active exception", see pytorch/pytorch#179291). Add this to a
    script whose processes exit after ``fit``; leave it out if the same process goes on using the
    process group after ``fit``: ``trainer.test()``, ``trainer.validate()``, or a
    ``trainer.save_checkpoint()`` (which gathers the data ledger from every rank, a collective call).
    """

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
