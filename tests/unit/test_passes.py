"""``shard.passes``: a pass at 0 workers is PyTorch's single-process iterator without its per-batch frame."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_sharding.strategies.shard import passes


class Squares(Dataset[dict[str, Any]]):
    """Task ``k`` -> a small batch; ``seen`` records the order tasks were asked in."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __getitem__(self, k: int) -> dict[str, Any]:
        self.seen.append(k)
        return {"x": torch.tensor([k, k * k]), "k": k}


def _loader(dataset: Squares, **kwargs: Any) -> DataLoader[Any]:
    tasks = [5, 2, 9, 0]
    return DataLoader(dataset, batch_size=None, sampler=tasks, collate_fn=lambda b: {**b, "collated": True}, **kwargs)


def test_a_pass_at_0_workers_serves_what_pytorchs_iterator_serves_and_draws_the_same_randomness() -> None:
    ours, theirs = Squares(), Squares()
    torch.manual_seed(3)
    got = list(passes(_loader(ours)))
    after_ours = torch.rand(4)
    torch.manual_seed(3)
    want = list(_loader(theirs))
    after_theirs = torch.rand(4)
    assert ours.seen == theirs.seen == [5, 2, 9, 0]
    assert [b["k"] for b in got] == [b["k"] for b in want] and all(b["collated"] for b in got)
    assert all(torch.equal(a["x"], b["x"]) for a, b in zip(got, want, strict=True))
    # One draw of torch's generator when the pass starts, as PyTorch's iterator: the model's randomness is unchanged.
    assert torch.equal(after_ours, after_theirs)


def test_the_sampler_is_asked_when_the_pass_starts_as_pytorchs_iterator_asks_it() -> None:
    asked: list[str] = []

    class Tasks:
        def __iter__(self) -> Any:
            asked.append("iter")
            return iter([1, 2])

    loader = DataLoader(Squares(), batch_size=None, sampler=Tasks())
    batches = passes(loader)
    assert asked == ["iter"], "before the first batch is asked for (the broadcast pool is made there)"
    assert [b["k"] for b in batches] == [1, 2]


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_with_workers_a_pass_is_the_dataloaders_own_iterator() -> None:
    loader = _loader(Squares(), num_workers=1, multiprocessing_context="fork")
    it = passes(loader)
    try:
        assert type(it).__name__ == "_MultiProcessingDataLoaderIter"
    finally:
        it._shutdown_workers()  # type: ignore[attr-defined]
