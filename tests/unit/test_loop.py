"""``ShardedData`` in one process: what a batch counts for, the state's round trips, and bad input named.

The kill-and-resume chains on other topologies, with Fabric and under torchrun, are in
tests/process/test_loops.py; here one process and no workers keep each rule quick to check.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_sharding import ShardedData, SyntheticReader
from lightning_sharding.core.ledger import CheckpointMismatchError
from lightning_sharding.core.rangeset import RangeSet

SIZES = [10, 7, 9]


def make(optimizer: torch.optim.Optimizer, **options: object) -> ShardedData:
    kwargs: dict[str, object] = dict(batch_size=4, num_workers=0, seed=3)
    kwargs.update(options)
    reader = kwargs.pop("reader", SyntheticReader(sizes=SIZES))
    return ShardedData(reader, optimizer=optimizer, **kwargs)


def sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)


def ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return batch["id"][~batch["is_padding"]].tolist()


def consumed(state: dict[str, object]) -> int:
    return len(RangeSet.from_state(np.asarray(state["ledger"][0]["consumed"])))  # type: ignore[index]


def test_a_batch_counts_once_a_step_after_it_returned_and_a_resume_serves_the_rest_once() -> None:
    optimizer = sgd()
    data = make(optimizer)
    seen: list[int] = []
    batches = data.train_loader(0)
    for _ in range(3):  # an accumulation window of 2, then one batch of the next window
        seen += ids(next(batches))
        if len(seen) == 8:
            optimizer.step()
    state = data.state_dict()
    assert consumed(state) == 8, "the third batch's step has not run: it is not in the weights"
    assert state["ledger"][0]["global_step"] == 1
    data.close()

    again = make(sgd())
    again.load_state_dict(state)
    rest = [i for batch in again.train_loader(again.epoch) for i in ids(batch)]
    assert sorted(seen[:8] + rest) == list(range(sum(SIZES))), "every sample once, the unstepped batch again"
    assert set(seen[8:]) <= set(rest)
    again.close()


def test_the_state_loads_with_weights_only_and_through_dcp_whatever_its_size(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    optimizer = sgd()
    data = make(optimizer)
    for n, _ in enumerate(data.train_loader(0)):
        optimizer.step()
        if n == 2:
            break
    buffer = io.BytesIO()
    torch.save({"data": data.state_dict()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["data"]
    assert consumed(loaded) == 12
    dcp.save({"data": data}, checkpoint_id=str(tmp_path / "dcp"))
    fresh = make(sgd())  # its own state (nothing consumed) is the template DCP loads into
    dcp.load({"data": fresh}, checkpoint_id=str(tmp_path / "dcp"))
    assert fresh.ledger.consumed == data.ledger.consumed and len(fresh.ledger.consumed) == 12
    data.close()
    fresh.close()


def test_an_epoch_left_with_unstepped_batches_is_warned_about() -> None:
    optimizer = sgd()
    data = make(optimizer)
    for _ in data.train_loader(0):
        pass  # never stepped
    with pytest.warns(UserWarning, match=r"yielded but no optimizer step has applied them yet"):
        data.train_loader(1)
    assert data.epoch == 1
    with pytest.raises(ValueError, match=r"train_loader\(0\): the ledger is at epoch 1 already"):
        data.train_loader(0)
    data.close()


def test_leaving_an_epoch_part_trained_is_warned_about_in_a_loops_words() -> None:
    optimizer = sgd()
    data = make(optimizer)
    for n, _ in enumerate(data.train_loader(0), 1):
        optimizer.step()
        if n == 2:
            break
    state = data.state_dict()
    with pytest.warns(UserWarning, match=r"train_loader\(1\) leaves epoch 0 after 8 of its 26 samples") as caught:
        data.train_loader(1)
    resumed = make(sgd())
    resumed.load_state_dict(state)
    with pytest.warns(UserWarning, match=r"call train_loader\(0\) first") as again:
        resumed.train_loader(1)
    assert not [w for w in [*caught, *again] if "Lightning" in str(w.message)], "a loop is not Lightning's"
    data.close()
    resumed.close()


def test_bad_input_is_named() -> None:
    with pytest.raises(TypeError, match=r"optimizer=None\) needs the torch optimizer"):
        ShardedData(SyntheticReader(sizes=SIZES), optimizer=None)
    with pytest.raises(TypeError, match=r"audit_dir=...\) is written by the Trainer's callback"):
        ShardedData(SyntheticReader(sizes=SIZES), optimizer=sgd(), audit_dir="audit")
    with pytest.raises(TypeError, match=r"val_reader=...\) is read by the Trainer's validation loop"):
        ShardedData(SyntheticReader(sizes=SIZES), optimizer=sgd(), val_reader=SyntheticReader(sizes=SIZES))
    with pytest.raises(ValueError, match=r"gather_timeout=0\)"):
        ShardedData(SyntheticReader(sizes=SIZES), optimizer=sgd(), gather_timeout=0)
    data = make(sgd())
    with pytest.raises(ValueError, match=r"state_dict\(\) returned.*got a dict with keys \['model'\]"):
        data.load_state_dict({"model": {}})
    other = make(sgd(), reader=SyntheticReader(sizes=[10, 7, 8]))
    with pytest.raises(CheckpointMismatchError, match=r"the loaded state was written for other data"):
        other.load_state_dict(data.state_dict())
    data.close()
    other.close()


def test_inspect_reads_a_loops_state_from_a_file_and_from_a_dcp_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.checkpoint as dcp

    from lightning_sharding import cli

    optimizer = sgd()
    data = make(optimizer)
    for n, _ in enumerate(data.train_loader(0)):
        optimizer.step()
        if n == 1:
            break
    model = torch.nn.Linear(2, 1)
    torch.save({"model": model.state_dict(), "data": data.state_dict()}, tmp_path / "loop.pt")
    dcp.save({"model": model.state_dict(), "data": data}, checkpoint_id=str(tmp_path / "dcp"))
    data.close()
    for path in (tmp_path / "loop.pt", tmp_path / "dcp"):
        assert cli.main(["inspect", str(path)]) == 0
        out = capsys.readouterr().out
        assert "consumed     8 of 26 samples" in out, out
        assert "state        ShardedData, under 'data'" in out and "matches      optimizer step 2" in out, out
    (tmp_path / "empty").mkdir()
    assert cli.main(["inspect", str(tmp_path / "empty")]) != 0
    assert "not a checkpoint file or a torch.distributed.checkpoint directory" in capsys.readouterr().err
