"""Checkpoints written by earlier versions resume with today's code, exactly once: the samples trained
before the save and after the resume make one uninterrupted epoch. The files were written by
``tests/fixtures/v0_checkpoints/make.py`` with 0.1.0 (before the package was regrouped into folders)
and by ``tests/fixtures/v0_2_checkpoints/make.py`` with 0.2 (before the loading engine left the
Lightning glue, issue 52). Old module paths import, warned."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest

from lightning_sharding import ShardedDataModule
from tests.fixtures.v0_2_checkpoints.make import HERE as HERE_0_2
from tests.fixtures.v0_checkpoints.make import HERE, Recorder, mixture, plain


def fit(make: Callable[[], ShardedDataModule], ckpt_path: str | None = None) -> list[int]:
    model = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(model, datamodule=make(), ckpt_path=ckpt_path)
    return model.seen


@pytest.mark.parametrize("written_by", [HERE, HERE_0_2], ids=["0.1", "0.2"])
@pytest.mark.parametrize("name, make", [("plain", plain), ("mixture", mixture)])
def test_a_checkpoint_of_an_earlier_version_resumes_exactly_once(
    name: str, make: Callable[[], ShardedDataModule], written_by: Path
) -> None:
    before = json.loads((written_by / f"{name}.json").read_text())["seen"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # today's code uses no moved path
        warnings.filterwarnings("ignore", module="lightning.*")
        after = fit(make, str(written_by / f"{name}.ckpt"))
    whole = fit(make)
    assert len(before) > 0 and len(after) > 0
    assert Counter(before) + Counter(after) == Counter(whole)
    if name == "plain":
        assert sorted(before + after) == list(range(120))


def test_old_module_paths_import_as_the_moved_module_with_a_deprecation_warning() -> None:
    import importlib
    import sys

    for old, new in [
        ("lightning_sharding.datamodule", "lightning_sharding.lightning.datamodule"),
        ("lightning_sharding.segments", "lightning_sharding.strategies._shared_memory"),
        ("lightning_sharding.mixture_change", "lightning_sharding.mixture.change"),
        ("lightning_sharding.keeper", "lightning_sharding.loading.keeper"),
        ("lightning_sharding.lightning.keeper", "lightning_sharding.loading.keeper"),
        ("lightning_sharding.lightning.loop", "lightning_sharding.loading.loop"),
        ("lightning_sharding.distributed.agreement", "lightning_sharding.loading.agreement"),
    ]:
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
            module = importlib.import_module(old)
        assert module is importlib.import_module(new)
