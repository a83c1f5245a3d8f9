"""Storage faults against the S3-protocol server on loopback, through a fault-injecting proxy.

A real Trainer trains on WebDataset shards in a bucket with 2 spawned DataLoader workers, while
the proxy (tests/support/fault_proxy.py) fails a seeded fraction of the requests or goes down for good.
Flaky storage must cost retries and nothing else; storage that stays down must stop training
with an error naming the object, and count nothing it did not train on.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import numpy.typing as npt
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sharding import SampleError, ShardedDataModule, ShardingCallback
from lightning_sharding.core.order import EpochOrder
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.loading.audit import audit
from lightning_sharding.readers import TarReader
from lightning_sharding.readers.storage import RetryPolicy
from lightning_sharding.recipes.synthetic_files import to_regression, write_regression
from tests.jobs.parts import RecordingModel
from tests.support.fault_proxy import FaultProxy
from tests.support.harness import assert_exactly_once, cpu_trainer, served_per_epoch
from tests.support.s3 import S3Server

SIZES = [23, 17, 29, 19]
TOTAL = sum(SIZES)


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    p = FaultProxy(s3_server.endpoint, seed=7)
    yield p
    p.close()


def shards(s3_server: S3Server, bucket: str) -> str:
    """Write the regression shards into ``bucket`` directly (not through the proxy); returns the glob."""
    write_regression(f"{s3_server.bucket(bucket)}/wds", "tar", SIZES, storage_options=s3_server.storage_options)
    return f"s3://{bucket}/wds/part-*.tar"


def datamodule(urls: str, proxy: FaultProxy, tmp_path: Path, retry: RetryPolicy, **kwargs: Any) -> ShardedDataModule:
    reader = TarReader(urls, storage_options=proxy.storage_options(), cache_dir=tmp_path / "cache", retry=retry)
    return ShardedDataModule(
        reader,
        transform=to_regression,
        batch_size=6,
        num_workers=2,
        seed=5,
        audit_dir=str(tmp_path / "audit"),
        **kwargs,
    )


def records(log: Path) -> list[dict[str, Any]]:
    path = Path(f"{log}-rank0.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def ids_of(positions: npt.NDArray[np.int64], seed: int, epoch: int = 0) -> list[int]:
    """The sample ids (manifest order) at epoch ``positions`` (shape ``(n,)``), sorted."""
    items, indices = EpochOrder(np.array(SIZES, dtype=np.int64), seed, epoch, shuffle=True).locate(positions)
    first = np.concatenate(([0], np.cumsum(SIZES)))
    return sorted((first[items] + indices).tolist())


def report(trainer: pl.Trainer) -> list[dict[str, Any]]:
    return next(cb for cb in trainer.callbacks if isinstance(cb, ShardingCallback)).summary()  # type: ignore[attr-defined]


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_a_fifth_of_requests_failing_costs_retries_and_the_epochs_stay_exactly_once(
    tmp_path: Path, s3_server: S3Server, proxy: FaultProxy
) -> None:
    urls = shards(s3_server, "flaky")
    proxy.fault_rate = 0.2  # 503s and dropped connections, on listings, index scans and sample reads
    retry = RetryPolicy(attempts=8, backoff=0.01, max_wait=0.2)
    dm = datamodule(urls, proxy, tmp_path, retry, persistent_workers=True)
    log = tmp_path / "seen"
    trainer = cpu_trainer(max_epochs=2)
    trainer.fit(RecordingModel(str(log)), datamodule=dm)
    assert_exactly_once(served_per_epoch(records(log)), TOTAL, epochs=2)
    assert [(e["consumed"], e["skipped"]) for e in report(trainer)] == [(TOTAL, 0)] * 2
    assert [(e.consumed, e.duplicates, e.missing) for e in audit([tmp_path / "audit"])] == [(TOTAL, 0, 0)] * 2
    # Faults really happened, of both kinds, about a fifth of the requests, and every failed request
    # was tried again. botocore's own retries are off (see FaultProxy.storage_options) and s3fs does
    # not retry a 503, so the 503s were recovered by lightning_sharding's RetryPolicy, in the workers.
    # (A batch reads each shard's samples with one request, so the job makes about 50 requests.)
    failed = proxy.counts["503"] + proxy.counts["dropped"]
    assert failed >= 0.1 * (failed + proxy.counts["forwarded"]), proxy.counts
    assert proxy.counts["503"] >= 3 and proxy.counts["dropped"] >= 2, proxy.counts
    assert proxy.counts["retried"] >= proxy.counts["503"] + proxy.counts["dropped"] - 2, proxy.counts


class TakeDown(pl.Callback):
    """Takes the storage down for good after ``step`` training steps."""

    def __init__(self, proxy: FaultProxy, step: int) -> None:
        self.proxy, self.step = proxy, step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.proxy.down()


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_storage_down_beyond_the_retry_budget_names_the_object_and_counts_nothing_unserved(
    tmp_path: Path, s3_server: S3Server, proxy: FaultProxy
) -> None:
    urls = shards(s3_server, "down")
    retry = RetryPolicy(attempts=3, backoff=0.05)
    log = tmp_path / "seen"
    dm = datamodule(urls, proxy, tmp_path, retry)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    trainer = cpu_trainer(callbacks=[checkpoints, TakeDown(proxy, step=3)], enable_checkpointing=True)
    with pytest.raises(SampleError) as err:
        trainer.fit(RecordingModel(str(log)), datamodule=dm)
    message = str(err.value)
    assert re.search(r"cannot read item 's3://down/wds/part-0000\d\.tar' \(rank 0, worker \d\)", message), message
    assert "failed after 3 attempts" in message and "resume from the last checkpoint" in message, message

    trained = [i for r in records(log) for i in r["ids"]]
    assert 3 <= len(records(log)) < TOTAL // 6  # it trained a few steps, then failed
    # What counts as consumed is exactly what was trained on: the ledger, the audit trail and the
    # newest checkpoint agree, and none of them holds a sample of the batches that failed to read.
    assert dm.ledger is not None and len(trained) == len(set(trained))
    assert ids_of(dm.ledger.trained.to_array(), seed=dm.ledger.seed) == sorted(trained)
    (epoch,) = audit([tmp_path / "audit"])
    assert epoch.consumed == len(trained) and epoch.duplicates == 0 and not epoch.complete
    newest = max((tmp_path / "ckpt").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    state = torch.load(newest, weights_only=True)["lightning_sharding"]
    saved = RangeSet.from_state(state["consumed"].numpy()).to_array()
    assert ids_of(saved, seed=state["seed"]) == sorted(trained) and state["epoch"] == 0

    # The storage comes back: the resumed epoch serves exactly what is left.
    proxy.up()
    resumed = tmp_path / "resumed"
    cpu_trainer().fit(
        RecordingModel(str(resumed)), datamodule=datamodule(urls, proxy, tmp_path, retry), ckpt_path=newest
    )
    seen = served_per_epoch(records(log) + records(resumed))
    assert_exactly_once(seen, TOTAL, epochs=1)
    assert Counter(np.concatenate([r["ids"] for r in records(resumed)]).tolist()).total() == TOTAL - len(trained)
