"""The ``lightning-sharding`` command line: ``plan`` tables and plots, ``inspect`` on a real checkpoint."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_sharding import cli
from lightning_sharding.core.manifest import Manifest
from lightning_sharding.core.order import EpochOrder
from lightning_sharding.core.plan import plan_epoch
from lightning_sharding.core.rangeset import RangeSet
from lightning_sharding.mixture import mixture_of
from lightning_sharding.readers.synthetic import SyntheticReader
from tests.support.extras import require

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ROW = re.compile(r"^\s+(\d+)\s+(all|\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(-|\d+)\s+(\d+)$")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def table(out: str) -> tuple[dict[int, list[int]], dict[tuple[int, int], list[int]]]:
    """Rank rows ``rank -> [samples, batches, padding, dropped, items]`` and worker rows
    ``(rank, worker) -> [samples, batches, padding, items]``."""
    ranks: dict[int, list[int]] = {}
    workers: dict[tuple[int, int], list[int]] = {}
    for line in out.splitlines():
        m = ROW.match(line)
        if not m:
            continue
        rank, worker, samples, batches, padding, dropped, items = m.groups()
        if worker == "all":
            ranks[int(rank)] = [int(samples), int(batches), int(padding), int(dropped), int(items)]
        else:
            workers[int(rank), int(worker)] = [int(samples), int(batches), int(padding), int(items)]
    return ranks, workers


def check_png(path: Path, min_bytes: int = 5000) -> tuple[int, ...]:
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > min_bytes
    image = imread(path)
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    return tuple(image.shape)


@pytest.mark.parametrize(
    ("num_items", "per_item", "world", "workers", "batch", "even"),
    [
        (16, 1000, 4, 2, 64, "pad"),
        (3, 10, 3, 2, 4, "pad"),
        (1, 17, 2, 2, 4, "drop"),
        (5, 7, 6, 0, 1, "pad"),
        (4, 9, 5, 3, 2, "drop"),
    ],
)
def test_plan_table_matches_plan_epoch(
    capsys: pytest.CaptureFixture[str], num_items: int, per_item: int, world: int, workers: int, batch: int, even: str
) -> None:
    code, out, err = run(
        capsys,
        "plan",
        f"data.num_items={num_items}",
        f"data.samples_per_item={per_item}",
        "--world-size",
        str(world),
        "--workers",
        str(workers),
        "--batch-size",
        str(batch),
        "--even-batches",
        even,
    )
    assert code == 0, err
    total = num_items * per_item
    plan = plan_epoch(
        total, RangeSet(), epoch=0, world_size=world, num_workers=workers, batch_size=batch, even_batches=even
    )
    ranks, by_worker = table(out)
    assert sorted(ranks) == list(range(world))
    assert all(row[1] == plan.num_batches for row in ranks.values())
    assert sum(row[0] for row in ranks.values()) + sum(row[3] for row in ranks.values()) == total
    assert [row[2] for row in ranks.values()] == plan.padding_per_rank.tolist()
    assert [row[3] for row in ranks.values()] == plan.dropped_per_rank.tolist()
    if workers:
        assert sorted(by_worker) == [(r, w) for r in range(world) for w in range(workers)]
        for r in range(world):
            assert sum(by_worker[r, w][0] for w in range(workers)) == ranks[r][0]
            assert sum(by_worker[r, w][1] for w in range(workers)) == plan.num_batches
    else:
        assert by_worker == {}
    assert f"{plan.num_batches} batch" in out and f"= {total} samples" in out


def test_plan_items_touched_agree_with_locate(capsys: pytest.CaptureFixture[str]) -> None:
    """Items per rank and worker, counted on ranges, equal the distinct items of EpochOrder.locate."""
    sizes = dict(num_items=6, samples_per_item=13)
    code, out, _ = run(
        capsys, "plan", *(f"data.{k}={v}" for k, v in sizes.items()), "--world-size", "3", "--workers", "2",
        "--batch-size", "5", "--seed", "11", "--epoch", "2",
    )  # fmt: skip
    assert code == 0
    ranks, by_worker = table(out)
    manifest = Manifest.from_items(SyntheticReader(6, 13, 16).items())
    order = EpochOrder(manifest.counts, 11, 2)
    plan = plan_epoch(manifest.total, RangeSet(), epoch=2, world_size=3, num_workers=2, batch_size=5)
    for r in range(3):
        rank = plan.rank(r)
        items, _ = order.locate(rank.positions.to_array())
        assert ranks[r][4] == np.unique(items).size
        for w in range(2):
            tasks = [rank.batch(b) for b in rank.worker_batches(w)]
            positions = np.concatenate([t.positions[: t.positions.size - t.num_padding] for t in tasks] or [[]])
            worker_items, _ = order.locate(positions.astype(np.int64))
            assert by_worker[r, w][3] == np.unique(worker_items).size
    assert "seed 11" in out and "epoch 2" in out


def test_plan_world_size_3_with_2_workers(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "data.num_items=3", "data.samples_per_item=10", "--world-size", "3",
                       "--workers", "2", "--batch-size", "4")  # fmt: skip
    assert code == 0
    ranks, by_worker = table(out)
    # 30 samples, 10 per rank: batches of 4, 4, 2; worker 0 takes two batches, worker 1 one.
    assert ranks == {r: [10, 3, 0, 0, 1] for r in range(3)}
    assert by_worker == {**{(r, 0): [8, 2, 0, 1] for r in range(3)}, **{(r, 1): [2, 1, 0, 1] for r in range(3)}}
    assert "world 3 ranks x 2 workers" in out


def test_plan_defaults_come_from_the_train_config(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "data.batch_size=7", "data.seed=5", "data.even_batches=drop")
    assert code == 0
    assert "batch size 7" in out and "seed 5" in out and "even_batches=drop" in out
    assert "16384 samples in 16 items" in out  # the train config's 16 items of 1024


def test_plan_large_world_is_one_screen(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "data.num_items=8", "data.samples_per_item=100", "--world-size", "40",
                       "--workers", "2", "--batch-size", "4")  # fmt: skip
    assert code == 0
    ranks, _ = table(out)
    assert sorted(ranks) == [*range(8), *range(32, 40)]
    assert any(line.strip() == "..." for line in out.splitlines())
    assert re.search(r"total\s+800\s+", out)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--world-size", "0"], "0"),
        (["--world-size", "two"], "'two'"),
        (["--workers", "-1"], "-1"),
        (["--strategy", "ring"], "'ring'"),
        (["--even-batches", "pd"], "'pd'"),
        (["data.num_itemz=3"], "num_itemz"),
        (["+data.bogus_key=1"], "bogus_key"),
        (["data.num_items=abc"], "abc"),
        (["data.num_items=0"], "num_items=0"),
        (["16"], "'16'"),
        (["--plot", "/no/such/dir/plan.png"], "/no/such/dir"),
        (["--bogus"], "--bogus"),
        (["--world-size", "4", "--data-parallel", "3"], "[1, 2, 4]"),
        (["--world-size", "2", "--data-parallel", "4"], "--data-parallel 4"),
        (["--data-parallel", "0"], "0"),
        (["--data-parallel", "2"], "world size 1 from trainer.devices x trainer.num_nodes; set --world-size"),
        (["--world-size", "4", "--data-parallel", "2", "--plot", "p.png"], "leave out --data-parallel"),
    ],
)
def test_plan_user_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], named: str) -> None:
    code, out, err = run(capsys, "plan", *argv)
    assert code != 0
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert named in err and "Traceback" not in err
    if argv[0] == "--strategy":
        assert "shard" in err  # the choices are named


DP_ROW = re.compile(r"^\s+(\d+)\s+(\d+)-(\d+)\s+(all|\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(-|\d+)\s+(\d+)$")


def test_plan_with_data_parallel_replicas_is_the_plan_of_the_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    """8 ranks in 4 replicas of 2: the rows are the 4 data-parallel ranks, each naming its 2 global
    ranks, with the numbers of a plain 4-rank plan; 8 of 8 is the plain table."""
    data = ["data.num_items=6", "data.samples_per_item=50", "--workers", "2", "--batch-size", "8"]
    code, out, err = run(capsys, "plan", *data, "--world-size", "8", "--data-parallel", "4")
    assert code == 0, err
    assert "world 8 ranks = 4 data-parallel replicas x 2 ranks that read the same batches x 2 workers" in out
    replicas: dict[tuple[int, str], list[int]] = {}
    for line in out.splitlines():
        m = DP_ROW.match(line)
        if m:
            dp, first, last, worker, *numbers = m.groups()
            assert (int(first), int(last)) == (2 * int(dp), 2 * int(dp) + 1)  # ModelParallelStrategy's layout
            replicas[int(dp), worker] = [int(n) for n in numbers if n != "-"]
    assert {dp for dp, _ in replicas} == {0, 1, 2, 3}
    _, plain, _ = run(capsys, "plan", *data, "--world-size", "4")
    ranks, workers = table(plain)
    assert {dp: replicas[dp, "all"] for dp in range(4)} == ranks
    assert {(dp, int(w)): row for (dp, w), row in replicas.items() if w != "all"} == workers
    assert "read by more than one replica" in out
    _, same, _ = run(capsys, "plan", *data, "--world-size", "4", "--data-parallel", "4")
    assert same == plain


@pytest.mark.parametrize("composition", ["mixed", "stratified", "per_stream"])
def test_plan_of_a_mixture_counts_each_streams_samples_per_rank_and_worker(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, composition: str
) -> None:
    """Per-stream columns, counted on ranges from the layout's prefixes, equal the streams of every
    single position the plan gives each rank and worker; the picture is the layout's."""
    from lightning_sharding.cli.plan import _compose, _manifest

    overrides = [f"data.cache_dir={tmp_path}", "recipe=mixture", "data.samples_per_epoch=1000"]
    overrides.append(f"data.batch_composition={composition}")
    args = ["--world-size", "3", "--workers", "2", "--batch-size", "16", "--even-batches", "drop", "--seed", "4"]
    code, out, err = run(capsys, "plan", *overrides, *args)
    assert code == 0, err
    manifest = _manifest(_compose(overrides), 16)
    mixture = mixture_of(manifest)
    assert mixture is not None and mixture.names == ("web", "code", "books")
    order = manifest.order(4, 0)
    assert order.total == 1000
    plan = plan_epoch(order, RangeSet(), world_size=3, num_workers=2, batch_size=16, even_batches="drop")
    row = re.compile(r"^\s+(\d+)\s+(all|\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(-|\d+)\s+(\d+)\s+(\d+)\s+(\d+)$")
    rows = {m[1] + "/" + m[2]: [int(m[i]) for i in (7, 8, 9)] for m in map(row.match, out.splitlines()) if m}
    for r in range(3):
        rank = plan.rank(r)
        streams, _ = order.streams(rank.positions.select(0, rank.num_served).to_array())
        assert rows[f"{r}/all"] == np.bincount(streams, minlength=3).tolist()
        for w in range(2):
            tasks = [rank.batch(b) for b in rank.worker_batches(w)]
            positions = np.concatenate([t.positions[: t.positions.size - t.num_padding] for t in tasks])
            streams, _ = order.streams(positions.astype(np.int64))
            assert rows[f"{r}/{w}"] == np.bincount(streams, minlength=3).tolist()
    if composition == "mixed":
        picture = "".join("WCB"[s] for s in order.streams(np.arange(64))[0].tolist())
        assert f"interleave of positions 0..63: {picture}" in out
    elif composition == "per_stream":  # web 654 = 40 batches of 16 + 14, code 218 = 13 + 10, books 8 x 16
        blocks = order.blocks
        assert blocks is not None and blocks.count == 63
        picture = "".join("WCB"[s] for s in order.streams(blocks.bounds(np.arange(63))[0])[0].tolist())
        assert f"per_stream batches of 16: the stream of batches 0..62: {picture}" in out
        assert (picture.count("W"), picture.count("C"), picture.count("B"), picture[-2:]) == (41, 14, 8, "WC")
    else:
        assert "stratified batches of 16, each within one sample of the shares web 10.46, code 3.49, books 2.05" in out
    assert "web: weight=3.0" in out and "books: repeat=2.0, 128 draws an epoch from 64 samples" in out
    assert "1000 samples in a mixture of 3 streams" in out and "dropped = 1000 samples" in out


def test_plan_of_recipe_anneal_shows_each_phase_and_its_draws(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``recipe=anneal``: web and code 3:1 for 70 % of the epoch (1024 positions), then code and books."""
    from lightning_sharding.cli.plan import _compose, _manifest

    overrides = [f"data.cache_dir={tmp_path}", "recipe=anneal"]
    code, out, err = run(capsys, "plan", *overrides, "--world-size", "2", "--workers", "2", "--seed", "3")
    assert code == 0, err
    assert "phase 0: positions 0..715: web 537, code 179" in out, out
    assert "phase 1: positions 716..1023: code 154, books 154" in out, out
    order = _manifest(_compose(overrides), 64).order(3, 0)
    firsts = re.findall(r"its first positions: ([WCB]+)", out)
    assert firsts == ["".join("WCB"[s] for s in order.streams(np.arange(lo, lo + 64))[0].tolist()) for lo in (0, 716)]
    assert set(firsts[0]) == {"W", "C"} and set(firsts[1]) == {"C", "B"}


def test_plan_of_a_schedule_over_training_shows_the_phases_of_the_epoch_it_plans(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Phases from samples of training: epoch 1 of 1024 holds the phase from sample 1,500 (its
    position 476) and the 16 steps of its ramp; epoch 2 is all of the last phase."""
    schedule = "data.schedule=[{samples: 0, shares: {web: 3, code: 1}}, {samples: 1500, shares: {books: 1}, ramp: 320}]"
    overrides = [f"data.cache_dir={tmp_path}", "recipe=anneal", schedule]
    code, out, err = run(capsys, "plan", *overrides, "--world-size", "2", "--epoch", "1")
    assert code == 0, err
    phases = re.findall(r"^phase (\d+): positions (\d+)\.\.(\d+): (.*)$", out, re.M)
    assert len(phases) == 1 + 16 + 1 and phases[0][1:3] == ("0", "475") and phases[1][1] == "476", out
    assert phases[-1][1:] == ("796", "1023", "books 228"), out
    code, out, err = run(capsys, "plan", *overrides, "--world-size", "2", "--epoch", "2")
    assert code == 0 and "phase 0: positions 0..1023: books 1024" in out and "phase 1" not in out, out


@pytest.mark.needs("matplotlib")
def test_plan_plot_of_a_mixture_draws_its_streams(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from matplotlib.image import imread

    overrides = [f"data.cache_dir={tmp_path}", "recipe=mixture", "data.batch_composition=per_stream"]
    code, out, err = run(capsys, "plan", *overrides, "--world-size", "2", "--plot", str(tmp_path / "p.png"))
    assert code == 0 and "plot written to" in out, err
    image = imread(tmp_path / "p.png")
    assert image.shape[0] > 100 and len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 4


def test_overrides_may_follow_or_surround_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", "--world-size", "2", "data.num_items=4", "--workers", "1",
                         "data.samples_per_item=5", "--batch-size", "2")  # fmt: skip
    assert code == 0, err
    assert "20 samples in 4 items" in out and "world 2 ranks x 1 worker," in out
    ranks, by_worker = table(out)
    assert ranks == {0: [10, 5, 0, 0, 2], 1: [10, 5, 0, 0, 2]}
    assert by_worker == {(0, 0): [10, 5, 0, 2], (1, 0): [10, 5, 0, 2]}


def test_plot_without_matplotlib_says_how_to_install_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)  # makes `import` raise ImportError
    path = tmp_path / "plan.png"
    code, _, err = run(capsys, "plan", "data.num_items=2", "data.samples_per_item=4", "--plot", str(path))
    assert code == 2
    assert 'pip install "lightning-sharding[plot]"' in err and len(err.strip().splitlines()) == 1
    assert not path.exists()


def test_audit_is_wired(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run(capsys, "audit", "--help")
    assert code == 0 and "directories" in out
    missing = tmp_path / "no-run"
    code, _, err = run(capsys, "audit", str(missing))
    assert code == 2 and str(missing) in err and len(err.strip().splitlines()) == 1


def test_help_and_no_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "plan" in out and "inspect" in out and "audit" in out
    code, _, err = run(capsys)
    assert code == 2 and "COMMAND" in err


def test_the_cli_does_not_import_lightning() -> None:
    """`lightning-sharding plan/inspect` must stay quick: no Lightning import on the way."""
    import subprocess
    import sys

    code = "import sys, lightning_sharding.cli; print('lightning' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.strip() == "False"


@pytest.mark.needs("matplotlib")
def test_plan_plot_writes_a_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "plan.png"
    code, out, err = run(capsys, "plan", "data.num_items=6", "data.samples_per_item=50", "--world-size", "3",
                         "--workers", "2", "--batch-size", "8", "--plot", str(path))  # fmt: skip
    assert code == 0, err
    assert f"plot written to {path}" in out
    height, width, _ = check_png(path)
    assert width == 1000 and height > 200


# -- inspect -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint: 3 steps of batch 4 over 30 samples, seed 7."""
    from lightning_sharding import ShardedDataModule
    from lightning_sharding.train import Regressor
    from tests.support.harness import cpu_trainer

    directory = tmp_path_factory.mktemp("ckpt")
    trainer = cpu_trainer(max_steps=3, default_root_dir=directory)
    datamodule = ShardedDataModule(
        SyntheticReader(sizes=[10, 10, 10]), batch_size=4, seed=7, audit_dir=str(directory / "audit")
    )
    trainer.fit(Regressor(dim=8, hidden=4, learning_rate=0.1), datamodule=datamodule)
    path = directory / "tiny.ckpt"
    trainer.save_checkpoint(path)
    return path


def test_inspect_of_a_packed_checkpoint_gives_the_packing_and_with_data_the_tokens_consumed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """recipe=pretrain trained 5 steps of 4 sequences; inspect names the packing, and with --data
    counts the tokens those 20 sequences hold, from the epoch's own order."""
    from hydra import compose, initialize_config_dir

    from lightning_sharding.config import CONF_DIR
    from lightning_sharding.train import run as train

    data = ["data.streams=[{name:web,documents:40,longest:30}]", "data.seq_len=16", f"data.cache_dir={tmp_path}"]
    overrides = [*data, "data.batch_size=4", "data.num_workers=0", "data.seed=3", "trainer.max_steps=5"]
    quiet = ["logger=none", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("train", overrides=["recipe=pretrain", *overrides, *quiet, f"out_dir={tmp_path / 'run'}"])
    train(cfg)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    code, out, err = run(capsys, "inspect", str(ckpt), "--data", "recipe=pretrain", *data)
    assert code == 0, err
    assert re.search(r"packing\s+'concat', seq_len 16: ([\d,]+) tokens of 40 documents", out), out
    planned = int(re.search(r"seq_len 16: ([\d,]+) tokens", out).group(1).replace(",", ""))  # type: ignore[union-attr]
    done = re.search(r"tokens\s+([\d,]+) consumed of ([\d,]+) in epoch 0, ([\d,]+) remaining", out)
    assert done is not None, out
    consumed, total, left = (int(g.replace(",", "")) for g in done.groups())
    assert total == planned and consumed + left == planned and 0 < consumed <= 20 * 16
    # --step names each sequence of a step by its documents' token ranges, replayed from the history.
    code, out, err = run(capsys, "inspect", str(ckpt), "--step", "2", "--data", "recipe=pretrain", *data)
    assert code == 0, err
    assert re.search(r"step\s+2 \(epoch 0\), 1 data-parallel ranks", out), out
    sequences = re.findall(r"^  position \d+: (.*)$", out, re.M)
    assert len(sequences) == 4, out
    for pieces in sequences:
        ranges = re.findall(r"document \d+ tokens \[(\d+), (\d+)\)", pieces)
        assert ranges and sum(int(b) - int(a) for a, b in ranges) <= 16, pieces
    code, out, err = run(capsys, "inspect", str(ckpt), "--step", "5")
    assert code != 0 and "step 5 is not in this checkpoint's training history, which covers steps 0 to 4" in err
    assert "--past names it" in err
    # --past: a step after the checkpoint, as its run went on (what skip= would leave out): the next 4 sequences.
    code, out, err = run(capsys, "inspect", str(ckpt), "--step", "5", "--past")
    assert code == 0 and "past         the checkpoint holds steps up to 4" in out, out + err
    assert re.search(r"rank 0: positions \[20, 24\)", out), out


def test_inspect_a_real_checkpoint(capsys: pytest.CaptureFixture[str], checkpoint: Path) -> None:
    code, out, err = run(capsys, "inspect", str(checkpoint))
    assert code == 0, err
    assert re.search(r"seed 7\b", out)
    assert "consumed     12 of 30 samples (40.0%)" in out
    assert "remaining    18 samples (60.0%)" in out
    assert "world_size 1 x num_workers 0, batch_size 4" in out
    assert "3 items, 30 samples, first synthetic-00000, last synthetic-00002" in out
    assert "ledger size  1 range, 16 bytes" in out
    assert "global_step 3" in out
    assert "matches      optimizer step 3: the samples whose gradients these weights hold" in out
    assert "WARNING" not in out
    fingerprint = Manifest.from_items(SyntheticReader(sizes=[10, 10, 10]).items()).fingerprint
    assert f"fingerprint {fingerprint[:16]}," in out


def test_audit_of_the_same_run(capsys: pytest.CaptureFixture[str], checkpoint: Path) -> None:
    code, out, err = run(capsys, "audit", str(checkpoint.parent))
    assert code == 0, err
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["0"])
    assert row[:3] == ["0", "30", "12"]  # epoch 0: 12 of 30 consumed, as the ledger says


@pytest.mark.needs("matplotlib")
def test_inspect_plot_writes_a_png(capsys: pytest.CaptureFixture[str], checkpoint: Path, tmp_path: Path) -> None:
    path = tmp_path / "progress.png"
    code, out, err = run(capsys, "inspect", str(checkpoint), "--plot", str(path))
    assert code == 0, err
    assert f"plot written to {path}" in out
    height, width, _ = check_png(path, min_bytes=3000)
    assert (height, width) == (180, 1000)


def test_inspect_checkpoint_without_ledger(
    capsys: pytest.CaptureFixture[str], checkpoint: Path, tmp_path: Path
) -> None:
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    del ckpt["lightning_sharding"]
    bare = tmp_path / "bare.ckpt"
    torch.save(ckpt, bare)
    code, out, err = run(capsys, "inspect", str(bare))
    assert code == 2
    assert out == ""
    assert "holds no lightning_sharding data ledger" in err and str(bare) in err


def test_inspect_mismatched_ledger(capsys: pytest.CaptureFixture[str], checkpoint: Path, tmp_path: Path) -> None:
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    ckpt["lightning_sharding"]["version"] = 99
    future = tmp_path / "future.ckpt"
    torch.save(ckpt, future)
    code, _, err = run(capsys, "inspect", str(future))
    assert code == 2
    assert "version 99" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("written_by", ["older version", "other step"])
def test_inspect_warns_when_the_ledger_may_not_match_the_weights(
    capsys: pytest.CaptureFixture[str], checkpoint: Path, tmp_path: Path, written_by: str
) -> None:
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    if written_by == "older version":
        del ckpt["lightning_sharding"]["global_step"]
        expected = "does not record the optimizer step it matches"
    else:
        ckpt["global_step"] = 5
        expected = "matches optimizer step 3 but its weights are of global_step 5"
    path = tmp_path / "suspect.ckpt"
    torch.save(ckpt, path)
    code, out, err = run(capsys, "inspect", str(path))
    assert code == 0, err
    warning = next(line for line in out.splitlines() if line.startswith("WARNING"))
    assert expected in warning and "matches      optimizer step" not in out


@pytest.mark.parametrize("kind", ["missing", "directory", "garbage"])
def test_inspect_bad_paths(capsys: pytest.CaptureFixture[str], tmp_path: Path, kind: str) -> None:
    path = tmp_path / "nowhere.ckpt"
    if kind == "directory":
        path = tmp_path
    elif kind == "garbage":
        path.write_text("not a checkpoint\n")
    code, out, err = run(capsys, "inspect", str(path))
    assert code != 0
    assert out == ""
    assert str(path) in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_items_touched_skip_empty_items() -> None:
    """A range running over an item of 0 samples does not count that item."""
    for seed in (1, 2):  # empty items between others (seed 1: order 0 1 2 3 4; seed 2: 2 4 1 3 0)
        order = EpochOrder([5, 0, 0, 5, 3], seed=seed, epoch=0)
        nonempty = cli._nonempty_slots(order)
        for lo, hi in [(0, 13), (2, 9), (4, 6), (0, 1), (3, 4), (5, 6), (12, 13)]:
            items, _ = order.locate(np.arange(lo, hi))
            assert len(cli._slots(order, RangeSet.interval(lo, hi), nonempty)) == np.unique(items).size


def test_plan_reads_a_recipe_and_its_topology(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.support.harness import ROOT

    recipes = str(ROOT / "recipes")
    code, out, _ = run(capsys, "plan", "--config-dir", recipes, "--config-name", "ddp_cpu", "data.num_items=4")
    assert code == 0
    assert "world 2 ranks x 2 workers" in out  # trainer.devices and data.num_workers of the recipe
    code, _, err = run(capsys, "plan", "--config-dir", recipes, "--config-name", "nope")
    assert code == 2 and "no recipe nope.yaml" in err


def test_plan_of_packed_documents_gives_each_rank_and_worker_its_tokens(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from lightning_sharding.tokens import IndexedTokens

    one_stream = "data.streams=[{name:web,documents:80,longest:60}]"
    overrides = [one_stream, "data.seq_len=16", f"data.cache_dir={tmp_path}"]
    code, out, err = run(capsys, "plan", "recipe=pretrain", *overrides, "--world-size", "2", "--workers", "2")
    assert code == 0, err
    corpus = IndexedTokens(str(next((tmp_path / "datasets").iterdir()) / "part-*.idx"))
    tokens = int(corpus.lengths(corpus.items()).sum())
    assert f"80 documents of {tokens:,} tokens, packed 'concat' into sequences of 16" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    by_rank = {int(r[0]): int(r[-1]) for r in rows if r[1] == "all"}
    by_worker = [int(r[-1]) for r in rows if r[1] != "all"]
    total = int(next(line for line in out.splitlines() if line.lstrip().startswith("total")).split()[-1])
    assert sum(by_rank.values()) == sum(by_worker) == total == tokens
    code, _, err = run(capsys, "plan", "recipe=pretrain", *overrides, "--plot", str(tmp_path / "p.png"))
    assert code != 0 and "a packed epoch's plan is printed only" in err


@pytest.mark.parametrize(
    ("recipe", "overrides", "strategy", "total"),
    [
        # dispatch: a generated table of data.rows rows, read in the source's own order
        ("sqlite", ["data.rows=300"], "dispatch", 300),
        # shard: 4 token files of 1,000 tokens cut into samples of 24 + 1 tokens: 1000 // 25 = 40 per file
        ("tokens", ["data.num_files=4", "data.tokens_per_file=1000", "data.sample_length=24"], "shard", 4 * 40),
        # shard: 3 generated JPEG shards of 10 images
        ("images", ["data.num_items=3", "data.samples_per_item=10", "data.image_size=16"], "shard", 30),
    ],
)
def test_plan_builds_any_recipes_data_with_its_strategy(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    recipe: str,
    overrides: list[str],
    strategy: str,
    total: int,
) -> None:
    code, out, err = run(
        capsys,
        "plan",
        f"recipe={recipe}",
        f"data.cache_dir={tmp_path}",
        *overrides,
        "--world-size",
        "2",
        "--workers",
        "2",
    )
    assert code == 0, err
    assert f"strategy {strategy}" in out
    assert f"{total} samples in" in out
    assert ("not shuffled" in out) == (strategy == "dispatch")
    ranks, _ = table(out)
    assert sum(row[0] for row in ranks.values()) == total


def test_plan_names_data_it_cannot_build(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(
        capsys, "plan", "recipe=tokens", f"data.cache_dir={tmp_path}", f"data.urls=[{tmp_path}/none-*.npy]"
    )
    assert code == 2
    assert "token_files" in err and f"{tmp_path}/none-*.npy" in err


def test_plan_of_data_files_reads_them_with_the_reader_of_their_format(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``plan PATH...`` (a directory, a glob, the files) plans what ``data=files`` with their format and
    ``data.urls`` plans; with a recipe chosen, the files are its ``data.urls``."""
    from lightning_sharding.recipes.synthetic_files import write_regression

    tars = write_regression(str(tmp_path / "tars"), "tar", [30, 30, 20])
    write_regression(str(tmp_path / "pq"), "parquet", [20, 20], row_group_size=8)
    common = [f"data.cache_dir={tmp_path / 'cache'}", "--world-size", "2", "--workers", "1"]
    listed = ["data=files", "data.format=tar", f"data.urls=[{tmp_path}/tars/*.tar]"]
    code, expected, err = run(capsys, "plan", *listed, *common)
    assert code == 0 and "80 samples in 3 items" in expected, err
    for data in ([str(tmp_path / "tars")], [f"{tmp_path}/tars/*.tar"], tars):
        code, out, err = run(capsys, "plan", *data, *common)
        assert (code, out) == (0, expected), err
    code, out, err = run(capsys, "plan", str(tmp_path / "pq"), "data.batch_size=4", *common)
    assert code == 0 and "40 samples in 6 items" in out and "batch size 4," in out, err  # row groups of 8
    require("PIL", "simplejpeg")  # recipe=images decodes its samples' images
    code, out, err = run(capsys, "plan", "recipe=images", str(tmp_path / "tars"), *common)
    assert code == 0 and "80 samples in 3 items" in out and "batch size 32," in out, err  # recipe=images' batch size


@pytest.mark.parametrize(
    ("data", "named"),
    [
        (["{tmp}/none.tar"], "'{tmp}/none.tar' names no file or directory"),
        (["{tmp}"], "{tmp} holds files of 2 formats (npy, tar): give a glob of its data files, such as '{tmp}/*.npy'"),
        (["{tmp}/a.tar", "{tmp}/b.npy"], "are files of 2 formats (npy, tar)"),
        (["{tmp}/c.bin"], "cannot tell the format of {tmp}/c.bin from its extension: give --format"),
        (["--format", "npy"], "--format npy is the format of data files: name them"),
    ],
)
def test_plan_names_data_files_it_cannot_read(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, data: list[str], named: str
) -> None:
    for name in ("a.tar", "b.npy", "c.bin"):
        (tmp_path / name).write_bytes(b"")
    code, out, err = run(capsys, "plan", *(d.format(tmp=tmp_path) for d in data))
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1
    assert named.format(tmp=tmp_path) in err


def test_inspect_shows_a_mixtures_keys_as_stream_and_path(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A mixture's item keys are ``"<stream>/"`` and its reader's key (``web//abs/path`` for a local
    file): inspect shows ``web:/abs/path``, in the ledger's first and last keys and in --data's."""
    from lightning_sharding.core.ledger import Ledger
    from lightning_sharding.mixture import MixtureReader, Stream
    from lightning_sharding.readers import NpyReader
    from lightning_sharding.recipes.synthetic_files import write_regression

    web, code = (
        write_regression(str(tmp_path / name), "npy", sizes) for name, sizes in (("web", [9, 9]), ("code", [6]))
    )
    reader = MixtureReader([Stream("web", NpyReader(web)), Stream("code", NpyReader(code))])
    manifest = reader.manifest()
    assert manifest.items[0].key == f"web/{web[0]}" and web[0].startswith("/")  # hence "web//..."
    state = Ledger(seed=0, total=manifest.total, manifest=manifest.summary()).state_dict()
    torch.save({"lightning_sharding": {**state, "consumed": torch.from_numpy(state["consumed"])}}, tmp_path / "m.ckpt")
    streams = [
        f"{{name: {n}, format: npy, urls: ['{u[0].rsplit('/', 1)[0]}/*.npy']}}"
        for n, u in (("web", web), ("code", code))
    ]
    data = ["data=mixture", f"data.streams=[{', '.join(streams)}]", "data.samples_per_epoch=null"]
    code_, out, err = run(capsys, "inspect", str(tmp_path / "m.ckpt"), "--data", *data, f"data.cache_dir={tmp_path}")
    assert code_ == 0, err
    assert f"first web:{web[0]}, last code:{code[0]}" in out
    assert f"data         3 items at web:{tmp_path}/\nsame data" in out and "//" not in out  # the streams' root
