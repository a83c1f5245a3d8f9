"""Language-model pretraining (issue 35): packed token sequences, exactly once in tokens, counted
in the weights, with real processes (a Lightning Trainer, DDP over gloo, spawned DataLoader
workers), across SIGKILL and resume on other ranks x workers, for each packing mode.

The corpus (tests/support/data/tokens.py) is four Megatron indexed files whose every token is a
distinct id, so the model's weight per token id counts how many times each token's gradient was
applied. Every epoch must add exactly 1 to every token the packing plans (all of them for
``concat`` and ``best_fit``; the first ``seq_len`` of each document for ``none``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_sharding.tokens import IndexedTokens, PackedReader, Packing
from tests.support.data.tokens import upload_corpus, write_corpus
from tests.support.harness import (
    Checks,
    Data,
    Job,
    Loading,
    Topology,
    Training,
    assert_exactly_once,
    check_resume,
    checkpoint_step,
    weights_at_epoch_ends,
)
from tests.support.replay import assert_replay_matches_audit
from tests.support.s3 import S3Server

SEQ_LEN = 16


def planned_tokens(corpus: Path, mode: str) -> np.ndarray:
    """The ids (1..T) of the tokens an epoch of ``mode`` trains, from the corpus's own documents."""
    reader = IndexedTokens(f"{corpus}/part-*.idx")
    planned = []
    for item in reader.items():
        start = 0
        for n in reader.document_lengths(item).tolist():
            tokens = np.asarray(reader.read_tokens(item, start, start + n), dtype=np.int64)
            planned.append(tokens[:SEQ_LEN] if mode == "none" else tokens)
            start += n
    return np.concatenate(planned)


def job(
    corpus: Path | str, mode: str, topology: Topology, accumulate: int = 1, batch_size: int = 3, **options: Any
) -> Job:
    """``options``: the reader's (a corpus in a bucket: storage_options, cache_dir...)."""
    data = Data(tokens={"dir": str(corpus), "seq_len": SEQ_LEN, "mode": mode, "options": options})
    training = Training(epochs=2, accumulate=accumulate)
    return Job(topology, data, Loading(batch_size=batch_size), training, checks=Checks(count_weights=True))


@pytest.mark.processes
@pytest.mark.timeout(500)
@pytest.mark.parametrize(("mode", "accumulate"), [("concat", 1), ("best_fit", 3), ("none", 1)])
def test_every_planned_token_is_trained_once_per_epoch_across_kills_on_other_topologies(
    tmp_path: Path, mode: str, accumulate: int
) -> None:
    """2 ranks x 2 workers, SIGKILLed after a checkpoint; 1 x 2 resumes and is SIGKILLed too; 2 x 1
    with batches of 5 sequences instead of 3 finishes two epochs. Every planned token is in exactly
    one applied step of each epoch, in the records and in the weights, and no other token is."""
    corpus = tmp_path / "corpus"
    total = write_corpus(corpus, files=4, documents=24)
    planned = planned_tokens(corpus, mode)
    out = tmp_path / "run"
    first = job(corpus, mode, Topology(2, 2), accumulate)
    # The last resume also takes another micro-batch size: the sequences do not depend on it.
    then = [job(corpus, mode, Topology(1, 2), accumulate), job(corpus, mode, Topology(2, 1), accumulate, 5)]
    first, *then = (j.but(checks=dict(audit=True)) for j in (first, *then))
    seen, segments = check_resume(out, first, then, checkpoint_every=3)
    assert all(s.returncode != 0 for s in segments[:2]), "the first two segments were killed mid-epoch"
    if mode == "none":  # the tokens past seq_len are never trained: only the planned ones count
        cut = np.setdiff1d(np.arange(1, total + 1), planned)
        assert cut.size > 0, "no document is longer than a sequence: this would not test the cut"
        for counts in seen.values():
            assert not set(counts) & set((cut - 1).tolist()), "a token past seq_len was trained"
            for t in (cut - 1).tolist():
                counts[t] = 1  # the cut tokens stand as served once, so the check below covers the rest
    assert_exactly_once(seen, total=total, epochs=2)
    weights = weights_at_epoch_ends(out, "seg2")
    assert sorted(weights) == [0, 1], f"epochs whose end saved weights: {sorted(weights)}"
    expected = np.zeros(total + 1)
    expected[planned] = 1.0
    for epoch, w in weights.items():
        np.testing.assert_array_equal(w, expected * (epoch + 1), err_msg=f"{mode}: tokens' weights after epoch {epoch}")
    # The last checkpoint's history names every step's sequences as the audit trail recorded them, across
    # both rescales (and the epoch's end), from the first run's steps on.
    steps = sorted(checkpoint_step(p) for p in segments[-1].checkpoints)
    resumed = steps[0] - 3  # where the last run started (its first checkpoint is 3 steps on)
    assert_replay_matches_audit(max(segments[-1].checkpoints, key=checkpoint_step), out, range(resumed + 1))


@pytest.mark.processes
@pytest.mark.needs("moto", "boto3", "s3fs")
@pytest.mark.timeout(300)
def test_megatron_files_in_a_bucket_train_every_token_once_across_a_kill_on_another_topology(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """The corpus's Megatron files served by the S3-protocol server on loopback (issue 55): each
    ``.idx`` read once for the job, the token ranges of a batch read by range. 2 ranks x 1 worker,
    SIGKILLed mid-epoch, resumed on 1 x 2 to the end of two epochs: every token is trained exactly
    once per epoch, counted in the weights."""
    total = write_corpus(tmp_path / "corpus", files=3, documents=16)
    url = upload_corpus(tmp_path / "corpus", f"{s3_server.bucket('megatron')}/corpus", s3_server.client())
    options = dict(storage_options=s3_server.storage_options, cache_dir=str(tmp_path / "cache"))
    out = tmp_path / "run"
    first, then = (job(url, "concat", Topology(*t), **options) for t in ((2, 1), (1, 2)))
    seen, segments = check_resume(out, first, [then], checkpoint_every=3)
    assert segments[0].returncode != 0, "the first segment was killed mid-epoch"
    assert_exactly_once(seen, total=total, epochs=2)
    weights = weights_at_epoch_ends(out, "seg1")
    assert sorted(weights) == [0, 1], f"epochs whose end saved weights: {sorted(weights)}"
    for epoch, w in weights.items():
        np.testing.assert_array_equal(w[1:], np.full(total, epoch + 1.0), err_msg=f"tokens' weights after {epoch}")
    assert not (tmp_path / "cache" / "shards").exists(), "without cache_limit, no copy of a file is kept"


@pytest.mark.processes
@pytest.mark.timeout(500)
def test_a_mixture_of_two_token_streams_trains_each_planned_token_once_across_kills(tmp_path: Path) -> None:
    """Two token streams (two corpora of distinct token ids), each packed with ``best_fit`` and
    drawn once an epoch: 2 x 2 killed, 1 x 2 killed, 2 x 1 to the end of two epochs; every token of
    both streams is trained exactly once per epoch, counted in the weights."""
    first_total = write_corpus(tmp_path / "web", files=3, documents=16)
    total = first_total + write_corpus(tmp_path / "code", files=2, documents=12, seed=1, first_token=first_total + 1)
    streams = [str(tmp_path / "web"), str(tmp_path / "code")]

    def mixed(topology: Topology) -> Job:
        data = Data(tokens={"streams": streams, "seq_len": SEQ_LEN, "mode": "best_fit"})
        return Job(topology, data, Loading(batch_size=3), Training(epochs=2), checks=Checks(count_weights=True))

    out = tmp_path / "run"
    seen, segments = check_resume(
        out, mixed(Topology(2, 2)), [mixed(Topology(1, 2)), mixed(Topology(2, 1))], checkpoint_every=3
    )
    assert all(s.returncode != 0 for s in segments[:2]), "the first two segments were killed mid-epoch"
    assert_exactly_once(seen, total=total, epochs=2)
    weights = weights_at_epoch_ends(out, "seg2")
    for epoch, w in weights.items():
        np.testing.assert_array_equal(
            w[1:], np.full(total, epoch + 1.0), err_msg=f"tokens' weights after epoch {epoch}"
        )
    assert sorted(weights) == [0, 1] and w[0] == 0.0  # the padding id is never trained


def test_the_sequences_do_not_depend_on_ranks_workers_or_batch_size(tmp_path: Path) -> None:
    """The epoch's sequences are a function of the documents, seed, epoch and packing alone: every
    rank's batches of 3 plans tile the same sequences as one process reading them all at once."""
    write_corpus(tmp_path, files=3, documents=9)
    reader = PackedReader(IndexedTokens(f"{tmp_path}/part-*.idx"), Packing(SEQ_LEN, "concat"))
    manifest = reader.manifest()
    whole = reader.read_sequences(manifest.order(5, 1), np.arange(manifest.total), manifest.items)
    parts = [
        reader.read_sequences(manifest.order(5, 1), np.arange(lo, min(lo + 3, manifest.total)), manifest.items)
        for lo in range(0, manifest.total, 3)
    ]
    for key in ("input_ids", "labels", "position_ids", "document_ids"):
        np.testing.assert_array_equal(whole[key].numpy(), np.concatenate([p[key].numpy() for p in parts]))
