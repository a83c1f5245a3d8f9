"""Item identity that survives a move (``lightning_sharding.core.identity``), through the ledger
keeper that restores checkpoints: the same files under another root, or touched, resume; a changed
byte is refused naming the file and what changed; a 0.1 checkpoint (items known by path and mtime)
resumes on the same paths, and on moved ones with ``root_map``. The kill-and-resume process tests
are tests/process/test_moved_data.py."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sharding import CheckpointMismatchError, NpyReader, ShardedDataModule, Stream
from lightning_sharding.core.ledger import Ledger
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.core.world import World
from lightning_sharding.loading.keeper import LedgerKeeper, moved_prefixes
from lightning_sharding.recipes.synthetic_files import to_regression, write_regression
from lightning_sharding.strategies.options import LoaderOptions
from tests.support.harness import cpu_trainer

SIZES = [30, 20, 25, 15]


def manifest_of(directory: Path, tmp_path: Path) -> Manifest:
    reader = NpyReader(str(directory / "*.npy"), cache_dir=str(tmp_path / "cache"))
    return Manifest.from_items(reader.items())


def checkpoint(manifest: Manifest) -> dict[str, Any]:
    ledger = Ledger(seed=3, total=manifest.total, manifest=manifest.summary())
    ledger.merge(RangeSet.interval(0, 17))
    return LedgerKeeper(ledger, manifest, World(), LoaderOptions(8)).state(global_step=2)


def resume(state: dict[str, Any], manifest: Manifest, **kw: Any) -> LedgerKeeper:
    fresh = Ledger(seed=3, total=manifest.total, manifest=manifest.summary())
    keeper = LedgerKeeper(fresh, manifest, World(), LoaderOptions(8), **kw)
    keeper.restore(state, global_step=2, source="last.ckpt")
    return keeper


@pytest.fixture
def data(tmp_path: Path) -> Path:
    write_regression(str(tmp_path / "dataA"), "npy", SIZES)
    return tmp_path / "dataA"


def test_the_same_files_under_another_root_resume_and_say_the_root_moved(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = checkpoint(manifest_of(data, tmp_path))
    shutil.copytree(data, tmp_path / "elsewhere" / "dataB", copy_function=shutil.copy)  # new mtimes
    keeper = resume(state, manifest_of(tmp_path / "elsewhere" / "dataB", tmp_path))
    assert len(keeper.ledger.consumed) == 17
    err = capsys.readouterr().err
    assert f"the data moved: {data}/ -> {tmp_path}/elsewhere/dataB/" in err
    # The next checkpoint knows the data where it is now.
    assert keeper.ledger.manifest["root"] == f"{tmp_path}/elsewhere/dataB/"


def test_a_touched_file_resumes(data: Path, tmp_path: Path) -> None:
    state = checkpoint(manifest_of(data, tmp_path))
    os.utime(data / sorted(os.listdir(data))[2], (1, 1))
    assert len(resume(state, manifest_of(data, tmp_path)).ledger.consumed) == 17


def test_a_changed_byte_is_refused_naming_the_file_and_what_changed(data: Path, tmp_path: Path) -> None:
    state = checkpoint(manifest_of(data, tmp_path))
    name = sorted(os.listdir(data))[2]
    raw = bytearray((data / name).read_bytes())
    raw[-3] ^= 0xFF  # same size, another value in the last row
    (data / name).write_bytes(bytes(raw))
    with pytest.raises(CheckpointMismatchError) as err:
        resume(state, manifest_of(data, tmp_path))
    message = str(err.value)
    assert f"{name!r} changed: same size, other content (its digest differs)" in message
    assert "allow_data_change=True" in message and "allow_mixture_change" not in message
    assert "root_map" not in message


def test_a_file_of_another_size_or_an_added_file_is_named(data: Path, tmp_path: Path) -> None:
    state = checkpoint(manifest_of(data, tmp_path))
    write_regression(str(tmp_path / "more"), "npy", [7, 9])
    shutil.copy(tmp_path / "more" / sorted(os.listdir(tmp_path / "more"))[1], data / "zz-extra.npy")
    with pytest.raises(CheckpointMismatchError, match=r"'zz-extra.npy' is new"):
        resume(state, manifest_of(data, tmp_path))


def old_checkpoint(manifest: Manifest) -> dict[str, Any]:
    """A checkpoint as 0.1 wrote it: the fingerprint by path and mtime, no root, no item table."""
    state = checkpoint(manifest)
    summary = dict(state["manifest"])
    summary["fingerprint"] = manifest.fingerprint_by_path()
    summary.pop("root")
    state["manifest"] = summary
    del state["items"]
    return state


def test_a_checkpoint_of_0_1_resumes_on_the_same_paths_and_on_moved_ones_with_a_root_map(
    data: Path, tmp_path: Path
) -> None:
    state = old_checkpoint(manifest_of(data, tmp_path))
    assert len(resume(state, manifest_of(data, tmp_path)).ledger.consumed) == 17
    moved = tmp_path / "scratch" / "dataA"
    moved.parent.mkdir()
    shutil.copytree(data, moved, copy_function=shutil.copy2)  # keeps mtimes, as rsync -t or cp -p
    with pytest.raises(CheckpointMismatchError) as err:
        resume(state, manifest_of(moved, tmp_path))
    hint = f"root_map={{'{tmp_path}/': '{tmp_path}/scratch/'}}"
    assert hint in str(err.value), str(err.value)
    keeper = resume(state, manifest_of(moved, tmp_path), root_map={f"{tmp_path}/": f"{tmp_path}/scratch/"})
    assert len(keeper.ledger.consumed) == 17


def test_moved_prefixes_cut_at_a_path_part() -> None:
    assert moved_prefixes("/lustre/ds/f0.npy", "/scratch/u/ds/f0.npy") == ("/lustre/", "/scratch/u/")
    assert moved_prefixes("s3://a/x/f.tar", "s3://b/x/f.tar") == ("s3://a/", "s3://b/")


def test_inspect_compares_a_checkpoint_with_the_data_it_would_resume_on(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from lightning_sharding.cli import main

    cache = f"data.cache_dir={tmp_path / 'cache'}"
    ckpt = tmp_path / "last.ckpt"
    torch.save({"lightning_sharding": checkpoint(manifest_of(data, tmp_path)), "global_step": 2}, ckpt)

    def inspect(directory: Path) -> str:
        overrides = ["data=files", "data.format=npy", f"data.urls=[{directory}/*.npy]", cache]
        assert main(["inspect", str(ckpt), "--data", *overrides]) == 0
        return capsys.readouterr().out

    shutil.copytree(data, tmp_path / "copy", copy_function=shutil.copy)
    assert f"the same items, sample counts and contents; it moved from {data}/: it resumes" in inspect(
        tmp_path / "copy"
    )
    names = sorted(os.listdir(data))
    write_regression(str(tmp_path / "longer"), "npy", [SIZES[0] + 1])
    shutil.copy(tmp_path / "longer" / os.listdir(tmp_path / "longer")[0], tmp_path / "copy" / names[0])  # a row more
    raw = bytearray((tmp_path / "copy" / names[3]).read_bytes())
    raw[-1] ^= 1
    (tmp_path / "copy" / names[3]).write_bytes(bytes(raw))
    out = inspect(tmp_path / "copy")
    assert "it would not resume (3 differences)" in out and "total was 90, now 91" in out
    assert f"'{names[3]}' changed: same size, other content (its digest differs)" in out
    assert f"'{names[0]}' holds {SIZES[0] + 1} samples, the checkpoint {SIZES[0]}" in out


class StreamRecorder(pl.LightningModule):
    """A linear model that records (stream, id) of every real sample it trains on, and those it held
    when a checkpoint was saved."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        self.seen: list[tuple[int, int]] = []
        self.at_save: list[tuple[int, int]] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        real = ~batch["is_padding"]
        self.seen += list(zip(batch["stream"][real].tolist(), batch["id"][real].tolist(), strict=True))
        return ((self.net(batch["x"].float()).squeeze(-1) - batch["y"].float()) ** 2).mean()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.at_save = list(self.seen)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_mixture_whose_stream_moved_to_another_root_resumes_exactly_once(tmp_path: Path) -> None:
    write_regression(str(tmp_path / "web"), "npy", [30, 20])
    write_regression(str(tmp_path / "old" / "code"), "npy", [25, 15])

    def datamodule(code_root: Path) -> ShardedDataModule:
        streams = [
            Stream("web", NpyReader(str(tmp_path / "web" / "*.npy"), cache_dir=str(tmp_path / "cache")), weight=2),
            Stream("code", NpyReader(str(code_root / "*.npy"), cache_dir=str(tmp_path / "cache")), weight=1),
        ]
        return ShardedDataModule(streams=streams, samples_per_epoch=72, batch_size=6, seed=5, transform=to_regression)

    first = StreamRecorder()
    save = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="mid", every_n_train_steps=4, save_top_k=1)
    cpu_trainer(max_steps=6, callbacks=[save], enable_checkpointing=True).fit(first, datamodule(tmp_path / "old/code"))
    moved = tmp_path / "new" / "place" / "code"
    shutil.copytree(tmp_path / "old" / "code", moved, copy_function=shutil.copy)
    shutil.rmtree(tmp_path / "old")  # nothing can read the old place
    resumed = StreamRecorder()
    cpu_trainer().fit(resumed, datamodule(moved), ckpt_path=str(tmp_path / "ckpt" / "mid.ckpt"))
    whole = StreamRecorder()
    cpu_trainer().fit(whole, datamodule(moved))
    assert len(first.at_save) == 24 and len(whole.seen) == 72
    assert Counter(first.at_save) + Counter(resumed.seen) == Counter(whole.seen)
