"""The epoch's batch count as the total of Lightning's progress bar (TQDM or Rich).

The train loader has no ``len()`` on purpose (with one, Lightning's fetcher would stop prefetching
and its epoch-end logic would change), so Lightning shows ``k/?``. The plan knows how many batches
this rank trains in the epoch, so the callback hands that number to whichever bar is shown.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar


def show_train_total(bar: Any, total: int) -> None:
    """Make ``bar`` (the trainer's ``progress_bar_callback``) show ``total`` training batches.

    A no-op for a bar that is disabled, not yet drawn, or of another kind.
    """
    if isinstance(bar, TQDMProgressBar):
        tqdm = bar._train_progress_bar  # None until the bar is drawn; the property raises then
        if tqdm is not None and tqdm.total != total:
            tqdm.total = total
            tqdm.refresh()
    elif isinstance(bar, RichProgressBar):
        task_id = getattr(bar, "train_progress_bar_id", None)  # None until drawn (after a mid-epoch resume)
        if bar.progress is not None and task_id is not None and bar.progress.tasks[task_id].total != total:
            bar.progress.update(task_id, total=total)


def train_total(bar: Any) -> float | None:
    """The total ``bar`` shows for training now (None when it shows none): what a user sees after ``k/``."""
    if isinstance(bar, TQDMProgressBar) and bar._train_progress_bar is not None:
        return bar._train_progress_bar.total  # type: ignore[no-any-return]
    if isinstance(bar, RichProgressBar) and bar.progress is not None:
        task_id = getattr(bar, "train_progress_bar_id", None)
        return None if task_id is None else bar.progress.tasks[task_id].total
    return None
