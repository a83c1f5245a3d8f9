"""A mixture of packed token streams changed on resume (``allow_mixture_change`` with ``packing=``):
the rest of the epoch serves no token of a sequence consumed before the change (while a stream has
sequences left), draws each stream's sequences at the new shares (shares in tokens too), restores
the same on every resume, and the next epoch is the new mixture's; what cannot be made exact (a
kept stream packed otherwise, a ``concat`` stream that drew from two of its passes) is refused by
name. Every token of the corpora is a distinct id, so a batch's tokens name what it trained. The
real-process test is tests/process/test_mixture_change.py."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_sharding import CheckpointMismatchError
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.plan import plan_epoch
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.mixture import MixtureReader, Stream, change_of, mixture_of
from lightning_sharding.mixture.composition import apportion
from lightning_sharding.tokens import PackedReader, Packing
from tests.support.data.tokens import packed_reader, write_corpus
from tests.unit.test_mixture_change import SEED, checkpoint, resume, scattered

SEQ_LEN = 16
MODES = ("concat", "best_fit", "none")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three corpora of distinct token ids: their directories, and each one's ids ``[lo, hi]``."""
    root = tmp_path_factory.mktemp("corpora")
    found: dict[str, Any] = {}
    first = 1
    for name, files, documents, seed in (("web", 3, 20, 0), ("code", 2, 15, 1), ("books", 1, 8, 2)):
        n = write_corpus(root / name, files=files, documents=documents, seed=seed, first_token=first)
        found[name] = (str(root / name), first, first + n - 1)
        first += n
    return found


def reader(corpora: dict[str, Any], shares: dict[str, dict[str, Any]], packing: Packing) -> MixtureReader:
    streams = [Stream(n, PackedReader(packed_reader(corpora[n][0]), packing), **s) for n, s in shares.items()]
    return MixtureReader(streams)


def tokens(mixed: MixtureReader, manifest: Manifest, order: Any, positions: np.ndarray) -> np.ndarray:
    """The token ids the sequences at ``positions`` of ``order`` hold (padding left out)."""
    if not len(positions):
        return np.zeros(0, np.int64)
    ids = mixed.read_sequences(order, np.asarray(positions, np.int64), manifest.items)["input_ids"].numpy().ravel()
    return ids[ids != 0].astype(np.int64)


def stream_of(corpora: dict[str, Any], ids: np.ndarray) -> Counter[str]:
    return Counter(n for i in ids.tolist() for n, (_, lo, hi) in corpora.items() if lo <= i <= hi)


CHANGES = [  # (before, after): shares in tokens, or a stream added or removed
    ({"web": {"tokens": 900}, "code": {"tokens": 300}}, {"web": {"tokens": 300}, "code": {"tokens": 900}}),
    ({"web": {"tokens": 600}, "code": {"tokens": 600}}, {"web": {"tokens": 800}, "books": {"tokens": 300}}),
    ({"web": {"weight": 1}, "code": {"tokens": 500}}, {"code": {"tokens": 200}, "web": {"tokens": 1100}}),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("old", "new"), CHANGES)
def test_the_rest_of_a_changed_packed_epoch_serves_no_token_consumed_before_at_the_new_shares(
    corpora: dict[str, Any], mode: str, old: dict[str, Any], new: dict[str, Any]
) -> None:
    packing = Packing(SEQ_LEN, mode)  # type: ignore[arg-type]
    before_reader, after_reader = reader(corpora, old, packing), reader(corpora, new, packing)
    before, after = before_reader.manifest(), after_reader.manifest()
    consumed = scattered(before.total, np.random.default_rng(len(mode)))
    trained = tokens(before_reader, before, before.order(SEED, 0), consumed.to_array())
    keeper = resume(checkpoint(before, consumed), after, allow_mixture_change=True)
    change = change_of(keeper.manifest)
    assert change is not None and keeper.manifest.order(SEED, 0) is change
    rest = after.total - len(consumed)
    assert rest > 0 and change.rest == rest
    assert (keeper.ledger.total, len(keeper.ledger.consumed)) == (after.total, len(consumed))
    # The plan serves the rest, every rest position once, on any topology.
    plan = plan_epoch(change, keeper.ledger.trained, world_size=2, num_workers=2, batch_size=4)
    served = np.sort(np.concatenate([t.positions[t.num_padding :] for r in range(2) for t in plan.rank(r).tasks()]))
    assert np.array_equal(served, np.arange(rest))
    drawn = tokens(after_reader, after, change, np.arange(rest))
    mixture = mixture_of(after)
    assert mixture is not None
    # Each stream's sequences in the rest: its share of the rest under the new shares, exactly.
    stream, _ = change.streams(np.arange(rest))
    assert np.bincount(stream, minlength=len(mixture.names)).tolist() == apportion(rest, list(mixture.draws))
    for report in change.report:
        lo, hi = corpora[report.name][1:]
        mine, before_mine = drawn[(drawn >= lo) & (drawn <= hi)], trained[(trained >= lo) & (trained <= hi)]
        if report.left is None:
            assert mine.size == 0, f"removed stream {report.name!r} is served"
        elif report.planned <= report.left:
            assert not np.intersect1d(mine, before_mine).size, f"{report.name!r}: a consumed token came again"
            assert np.unique(mine).size == mine.size, f"{report.name!r}: the rest serves a token twice"
    # A second restore of the changed epoch draws the same rest; the next epoch is the new mixture's.
    again = resume(keeper.state(global_step=5), after)
    assert np.array_equal(tokens(after_reader, after, again.manifest.order(SEED, 0), np.arange(rest)), drawn)
    again.ledger.start_epoch(1)
    assert (again.ledger.total, again.ledger.change) == (after.total, None)
    next_epoch = np.arange(min(20, after.total))
    assert np.array_equal(
        tokens(after_reader, after, again.manifest.order(SEED, 1), next_epoch),
        tokens(after_reader, after, after.order(SEED, 1), next_epoch),
    )


@pytest.mark.parametrize("mode", ["best_fit", "none"])
def test_a_packed_stream_asking_for_more_than_it_has_left_serves_all_it_has_left_first(
    corpora: dict[str, Any], mode: str
) -> None:
    """``best_fit`` and ``none`` name their sequences alike in every pass, so a stream that repeats
    serves what it has left, then what it consumed once (a repeat before the change too)."""
    packing = Packing(SEQ_LEN, mode)  # type: ignore[arg-type]
    old = {"books": {"repeat": 1.5}, "code": {"repeat": 0.5}}
    before_reader, after_reader = reader(corpora, old, packing), reader(corpora, {"books": {"repeat": 3.0}}, packing)
    before, after = before_reader.manifest(), after_reader.manifest()
    consumed = RangeSet.interval(0, before.total // 2)
    keeper = resume(checkpoint(before, consumed), after, allow_mixture_change=True)
    change = change_of(keeper.manifest)
    assert change is not None
    (books,) = change.rest_streams
    assert change.rest > books.left > 0, "the stream asks for more than it has left"
    order = before.order(SEED, 0)
    stream, _ = order.streams(consumed.to_array())
    trained = tokens(before_reader, before, order, consumed.to_array()[stream == 0])
    # Every sequence of books is served within one of the others over the whole epoch.
    drawn = tokens(after_reader, after, change, np.arange(change.rest))
    per_token = Counter(trained.tolist()) + Counter(drawn.tolist())
    assert max(per_token.values()) - min(per_token.values()) <= 1, per_token
    left_first = tokens(after_reader, after, change, np.arange(books.left))
    assert not np.intersect1d(left_first, trained).size, "what it had left comes first"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    mode=st.sampled_from(MODES),
    cuts=st.lists(st.integers(0, 10_000), min_size=2, max_size=6),
    web=st.integers(50, 1100),
    code=st.integers(50, 700),
    seed=st.integers(0, 2**16),
)
def test_no_sequence_consumed_before_a_change_is_drawn_again_while_its_stream_has_any_left(
    corpora: dict[str, Any], mode: str, cuts: list[int], web: int, code: int, seed: int
) -> None:
    """Any consumed set of an epoch of streams drawn at most once an epoch, any new shares in tokens:
    a stream's rest draws none of the tokens it trained before the change, no token twice, and
    exactly its share of the rest."""
    packing = Packing(SEQ_LEN, mode)  # type: ignore[arg-type]
    old = {"web": {"tokens": 700}, "code": {"tokens": 400}}
    before_reader = reader(corpora, old, packing)
    after_reader = reader(corpora, {"web": {"tokens": web}, "code": {"tokens": code}}, packing)
    before, after = before_reader.manifest(), after_reader.manifest()
    bounds = sorted({c % (before.total + 1) for c in cuts})
    consumed = RangeSet.from_ranges((a, b) for a, b in zip(bounds[::2], bounds[1::2], strict=False) if b > a)
    state = checkpoint(before, consumed)
    state["seed"] = seed
    keeper = resume(state, after, allow_mixture_change=True)
    change = change_of(keeper.manifest)
    assert change is not None
    trained = tokens(before_reader, before, before.order(seed, 0), consumed.to_array())
    drawn = tokens(after_reader, after, change, np.arange(change.rest))
    for report in change.report:
        lo, hi = corpora[report.name][1:]
        mine = drawn[(drawn >= lo) & (drawn <= hi)]
        if report.planned <= report.left:
            assert not np.intersect1d(mine, trained).size and np.unique(mine).size == mine.size, report


def test_a_kept_stream_packed_otherwise_or_a_concat_stream_past_its_first_pass_is_refused_by_name(
    corpora: dict[str, Any],
) -> None:
    old = {"web": {"tokens": 600}, "books": {"repeat": 2.0}}
    before = reader(corpora, old, Packing(SEQ_LEN, "concat")).manifest()
    state = checkpoint(before, RangeSet.interval(0, before.total * 3 // 4))
    for packing, what in (
        (Packing(2 * SEQ_LEN, "concat"), "seq_len was 16, now 32"),
        (Packing(SEQ_LEN, "best_fit"), "mode was 'concat', now 'best_fit'"),
    ):
        after = reader(corpora, {"web": {"tokens": 300}, "books": {"repeat": 2.0}}, packing).manifest()
        with pytest.raises(CheckpointMismatchError, match=rf"stream 'web' is packed otherwise than in the checkpoint "
                           rf"\({what}"):  # fmt: skip
            resume(state, after, allow_mixture_change=True)
    # books (repeat 2.0) had drawn from both of its passes: concat cuts each pass into other sequences.
    after = reader(corpora, {"web": {"tokens": 300}, "books": {"repeat": 1.0}}, Packing(SEQ_LEN, "concat")).manifest()
    with pytest.raises(CheckpointMismatchError, match=r"stream 'books' packs with mode='concat' and had drawn from 2 "):
        resume(state, after, allow_mixture_change=True)
    # Removed, it is no trouble: nothing of it is drawn again.
    keeper = resume(state, reader(corpora, {"web": {"tokens": 300}}, Packing(SEQ_LEN, "concat")).manifest(),
                    allow_mixture_change=True)  # fmt: skip
    assert change_of(keeper.manifest) is not None
