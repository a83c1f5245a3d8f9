"""What Lightning's loops will do on a restart, computed before they do it (for the DataModule)."""

from __future__ import annotations

import lightning.pytorch as pl


def epoch_lightning_runs_next(trainer: pl.Trainer) -> int:
    """The epoch the iterator created now will serve.

    Lightning creates (and prefetches from) the train iterator in ``setup_data``, before its loops'
    ``reset()`` decides how a restart goes and before it calls ``set_epoch``. A checkpoint written
    in ``on_train_batch_end`` of an epoch's last batch restarts into the next epoch without another
    iterator, so the ledger must already be on that epoch; one written later on the same batch (at
    validation end, say) finishes the saved epoch first, with this iterator. The restart stage is
    computed here from the restored counters exactly as ``FitLoop.reset()`` will compute it.
    """
    fit_loop = trainer.fit_loop
    epoch = int(getattr(fit_loop.epoch_progress.current, "processed", trainer.current_epoch))
    if not fit_loop.restarting:
        return epoch
    fit_loop.update_restart_stage()  # reads the counters only; FitLoop.reset() computes it again
    epoch_loop = fit_loop.epoch_loop
    on_last_batch_end = epoch_loop.restarted_on_train_batch_end and epoch_loop.batch_progress.is_last_batch
    if on_last_batch_end and fit_loop.restarted_mid_epoch:
        epoch += 1  # FitLoop.reset() counts the saved epoch as processed
    return epoch
