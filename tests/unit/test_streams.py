"""Streams in the DataModule: a real Trainer in this process reads a mixture at its shares; a
checkpoint of one mixture refuses another, naming the stream; bad input names the stream."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from lightning_sharding import CheckpointMismatchError, ShardedDataModule, SyntheticReader
from lightning_sharding.mixture.streams import MixtureReader, Stream
from tests.support.harness import cpu_trainer


class Tagged(SyntheticReader):
    """Synthetic samples that carry their stream's number in ``"stream"``."""

    def __init__(self, tag: int, sizes: list[int]) -> None:
        super().__init__(sizes=sizes)
        self.tag = tag

    def read_batch(self, item: Any, indices: Any, ctx: Any) -> list[Any]:
        return [{**s, "stream": self.tag} for s in super().read_batch(item, indices, ctx)]


class Counting(pl.LightningModule):
    """Counts the real samples of each stream that training steps saw, per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        self.seen: dict[int, Counter[tuple[int, int]]] = {}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        real = ~batch["is_padding"]
        pairs = zip(batch["stream"][real].tolist(), batch["id"][real].tolist(), strict=True)
        self.seen.setdefault(self.current_epoch, Counter()).update(pairs)
        return torch.nn.functional.mse_loss(self.net(batch["x"]).squeeze(-1), batch["y"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def streams(**shares: Any) -> list[Stream]:
    sizes = {"web": [40, 60], "code": [30], "books": [10]}
    return [Stream(name, Tagged(i, sizes[name]), **share) for i, (name, share) in enumerate(shares.items())]


def three_streams(seed: int) -> ShardedDataModule:
    """web (weight 3) and code (weight 1) down-sampled, books twice over: 75 + 25 + 20 = 120 an epoch."""
    return ShardedDataModule(
        streams=streams(web={"weight": 3}, code={"weight": 1}, books={"repeat": 2.0}),
        samples_per_epoch=120,
        batch_size=8,
        seed=seed,
    )


def test_a_mixture_trains_at_its_shares_with_repeats_only_where_asked() -> None:
    dm = three_streams(seed=1)
    model = Counting()
    cpu_trainer(max_epochs=3).fit(model, datamodule=dm)
    assert dm.manifest is not None and [s["draws"] for s in dm.manifest.summary()["streams"]] == [75, 25, 20]
    for epoch, seen in model.seen.items():
        per_stream = Counter(stream for (stream, _), n in seen.items() for _ in range(n))
        assert per_stream == {0: 75, 1: 25, 2: 20}, epoch
        assert all(n == 1 for (stream, _), n in seen.items() if stream < 2), "down-sampled: never twice an epoch"
        assert all(n == 2 for (stream, _), n in seen.items() if stream == 2), "books: every sample twice"
    # Over 3 epochs the down-sampled code stream (25 of 30 an epoch) has covered all of itself.
    code = {i for seen in model.seen.values() for (stream, i) in seen if stream == 1}
    assert code == set(range(30))


def test_a_checkpoint_of_one_mixture_refuses_another_naming_the_stream(tmp_path: Path) -> None:
    first = ShardedDataModule(streams=streams(web={"weight": 3}, code={"weight": 1}), batch_size=8, seed=1)
    trainer = cpu_trainer(max_steps=3)
    trainer.fit(Counting(), datamodule=first)
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    changed = ShardedDataModule(streams=streams(web={"weight": 1}, code={"weight": 1}), batch_size=8, seed=1)
    with pytest.raises(CheckpointMismatchError, match=r"stream 'web' share was 'weight=3', now 'weight=1'"):
        cpu_trainer(max_steps=6).fit(Counting(), datamodule=changed, ckpt_path=tmp_path / "mid.ckpt")


def test_max_steps_over_a_mixture_rolls_epochs_over_and_resumes_exactly(tmp_path: Path) -> None:
    """Training by steps with no epoch to care about: 40 steps of 8 over epochs of 120 draws run
    2 2/3 epochs; resuming from the checkpoint written at step 20 (mid-epoch 1) trains the very
    batches the uninterrupted run trained after it. A checkpoint written after fit() returned, which
    Lightning resumes in the next epoch, names the samples of the epoch it skips."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Steps(Counting):
        def __init__(self) -> None:
            super().__init__()
            self.steps: list[tuple[int, list[tuple[int, int]]]] = []

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            real = ~batch["is_padding"]
            self.steps.append(
                (self.current_epoch, list(zip(batch["stream"][real].tolist(), batch["id"][real].tolist(), strict=True)))
            )
            return super().training_step(batch, batch_idx)

    def fit(max_steps: int, ckpt: Path | None = None, **trainer: Any) -> Steps:
        dm = three_streams(seed=3)
        model = Steps()
        fitted = cpu_trainer(max_epochs=-1, max_steps=max_steps, **trainer)
        fitted.fit(model, datamodule=dm, ckpt_path=ckpt)
        assert fitted.global_step == max_steps
        if max_steps == 20:
            fitted.save_checkpoint(tmp_path / "after_fit.ckpt")
        return model

    every_20 = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=20, save_top_k=-1)
    whole = fit(40, callbacks=[every_20], enable_checkpointing=True)
    assert sorted(whole.seen) == [0, 1, 2]
    assert [sum(whole.seen[e].values()) for e in (0, 1, 2)] == [120, 120, 80]
    for epoch in (0, 1):  # whole epochs: each stream at its draws, repeats only where asked
        per_stream = Counter(stream for (stream, _), n in whole.seen[epoch].items() for _ in range(n))
        assert per_stream == {0: 75, 1: 25, 2: 20}
    resumed = fit(40, tmp_path / "step=20.ckpt")
    assert [e for e, _ in whole.steps[20:]] == [1] * 10 + [2] * 10
    assert resumed.steps == whole.steps[20:]

    fit(20)
    with pytest.warns(UserWarning, match=r"stopped epoch 1 after 40 of its 120 samples.*other 80 samples"):
        skipped = fit(40, tmp_path / "after_fit.ckpt")
    assert sorted(skipped.seen) == [2, 3]  # Lightning's choice, now said


def test_samples_per_epoch_of_a_single_reader_sets_the_epoch() -> None:
    dm = ShardedDataModule(Tagged(0, [10, 20]), samples_per_epoch=12, batch_size=4, seed=2)
    model = Counting()
    cpu_trainer(max_epochs=5).fit(model, datamodule=dm)
    assert [sum(seen.values()) for seen in model.seen.values()] == [12] * 5
    assert all(n == 1 for seen in model.seen.values() for n in seen.values()), "never twice in an epoch"
    # 12 of 30 an epoch: epochs 0-2 cover every sample, the third one topping up with 6 of the first.
    cycle = Counter(i for epoch in (0, 1, 2) for (_, i) in model.seen[epoch])
    assert set(cycle) == set(range(30)) and sum(cycle.values()) == 36 and max(cycle.values()) == 2
    first_two = [i for epoch in (0, 1) for (_, i) in model.seen[epoch]]
    assert len(set(first_two)) == 24, "no sample twice before the stream is covered"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reader": SyntheticReader(), "streams": []}, "give `reader=` or `streams=`, not both"),
        ({"streams": []}, r"streams= needs one or more Stream"),
        ({"streams": Stream("a", SyntheticReader())}, r"takes a list of Stream"),
        (
            {"streams": [Stream("a", SyntheticReader()), Stream("a", SyntheticReader())]},
            r"\['a'\] appear more than once",
        ),
        ({"streams": [Stream("a", SyntheticReader())], "strategy": "dispatch"}, "source="),
    ],
)
def test_bad_streams_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardedDataModule(**kwargs)


def test_a_strategy_that_cannot_mix_says_which_can() -> None:
    from lightning_sharding.strategies import get_strategy

    reader = MixtureReader([Stream("a", SyntheticReader())])
    with pytest.raises(
        ValueError,
        match=r"strategy 'broadcast' does not read a mixture of streams; use sharding='shard' or sharding='dali'",
    ):
        get_strategy("broadcast").check_data(reader, "ShardedDataModule")


def test_an_empty_stream_is_named() -> None:
    empty = MixtureReader([Stream("a", SyntheticReader()), Stream("empty", SyntheticReader(sizes=[0, 0]))])
    with pytest.raises(ValueError, match=r"stream 'empty' has no samples \(2 items\)"):
        empty.manifest()
    assert np.array_equal(MixtureReader([Stream("a", SyntheticReader(sizes=[3]))]).manifest().counts, [3])


def test_the_logger_and_inspect_count_each_stream(tmp_path: Path) -> None:
    import torch as _torch

    from lightning_sharding.cli.checkpoint import format_inspect

    dm = ShardedDataModule(streams=streams(web={"weight": 3}, code={"choose": 25}), batch_size=10, seed=0)
    model = Counting()
    trainer = cpu_trainer(max_epochs=2, max_steps=15)  # 13 steps an epoch (100 + 25 draws): 2 into epoch 1
    trainer.fit(model, datamodule=dm)
    in_epoch_1 = Counter(stream for (stream, _), n in model.seen[1].items() for _ in range(n))
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if "stream" in k}
    assert logged == {"data/stream/web": in_epoch_1[0], "data/stream/code": in_epoch_1[1]}, "the stopped epoch's"
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    report = format_inspect(tmp_path / "mid.ckpt", _torch.load(tmp_path / "mid.ckpt", weights_only=True))
    assert f"stream       'web' (weight=3, 100 samples): consumed {in_epoch_1[0]} of 100 draws" in report, report
    assert f"stream       'code' (choose=25, 30 samples): consumed {in_epoch_1[1]} of 25 draws" in report, report
    full = cpu_trainer(max_epochs=1)
    full.fit(Counting(), datamodule=ShardedDataModule(streams=streams(web={"weight": 3}, code={"choose": 25})))
    assert {k: float(v) for k, v in full.callback_metrics.items() if "stream" in k} == {
        "data/stream/web": 100.0,
        "data/stream/code": 25.0,
    }


def test_the_mixture_config_names_a_bad_stream(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hydra import compose, initialize_config_dir

    from lightning_sharding.cli.main import main
    from lightning_sharding.config import CONF_DIR
    from lightning_sharding.train import build_datamodule

    overrides = [f"data.cache_dir={tmp_path}", "recipe=mixture"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("train", overrides=[*overrides, "+data.streams.1.choose=5"])
    with pytest.raises(Exception, match=r"data.streams\[1\]: stream 'code' sets weight and choose"):
        build_datamodule(cfg)  # Hydra's InstantiationException, naming the stream's key
    assert main(["plan", *overrides, "+data.streams.1.choose=5"]) == 2
    err = capsys.readouterr().err
    assert "data.streams[1]: stream 'code' sets weight and choose" in err
    assert "set the others to null, e.g. data.streams.1.weight=null" in err
    fixed = ["data.streams.1.weight=null", "+data.streams.1.choose=5"]
    assert main(["plan", *overrides, *fixed]) == 0, capsys.readouterr().err
    assert "code: choose=5, 5 draws an epoch" in capsys.readouterr().out


class Marked(SyntheticReader):
    """Synthetic samples that carry their stream's number in ``"mark"`` (not the loader's ``"stream"``)."""

    def __init__(self, mark: int, sizes: list[int]) -> None:
        super().__init__(sizes=sizes)
        self.mark = mark

    def read_batch(self, item: Any, indices: Any, ctx: Any) -> list[Any]:
        return [{**s, "mark": self.mark} for s in super().read_batch(item, indices, ctx)]


@pytest.mark.parametrize("composition", ["mixed", "stratified"])
def test_every_sample_knows_its_stream_in_its_context_and_its_batch(composition: str) -> None:
    from lightning_sharding.core.ledger import Ledger
    from lightning_sharding.core.world import World
    from lightning_sharding.strategies import get_strategy
    from lightning_sharding.strategies.options import LoaderOptions

    names = ("web", "code", "books")
    streams = [Stream(n, Marked(k, [11, 7, 5][k : k + 1] * 2), weight=k + 1) for k, n in enumerate(names)]
    reader = MixtureReader(streams, 60, composition=composition, batch_size=None if composition == "mixed" else 6)
    told: list[tuple[int, str | None]] = []
    rows: list[tuple[int, int]] = []

    def transform(sample: dict[str, Any], ctx: Any) -> dict[str, Any]:
        told.append((int(sample["mark"]), ctx.stream))
        return sample

    def batch_transform(batch: dict[str, Any], ctx: Any) -> dict[str, Any]:
        assert ctx.stream_names == names
        rows.extend(zip(batch["mark"].tolist(), ctx.streams.tolist(), strict=True))
        return batch

    options = LoaderOptions(batch_size=6, transform=transform, batch_transform=batch_transform)
    manifest = reader.manifest(6)
    ledger = Ledger(seed=1, total=manifest.total, manifest=manifest.summary())
    loader = get_strategy("shard").build(reader, manifest, ledger, World(), options, track=True)
    per_stream: Counter[str] = Counter()
    for batch in loader:
        loader.pop_delivered()
        assert batch["stream"].dtype == torch.int64
        assert batch["stream"].tolist() == batch["mark"].tolist()
        real = ~batch["is_padding"]
        per_stream.update(names[s] for s in batch["stream"][real].tolist())  # a per-stream count, as a loss would
    loader.close()
    assert told and all(names[mark] == stream for mark, stream in told)
    assert rows and all(mark == stream for mark, stream in rows)
    draws = dict(zip(names, mixture_draws(manifest), strict=True))
    assert per_stream == Counter(draws)


def mixture_draws(manifest: Any) -> tuple[int, ...]:
    from lightning_sharding.mixture import mixture_of

    mixture = mixture_of(manifest)
    assert mixture is not None
    return mixture.draws
