"""The train entry: every recipe end to end with a tiny budget, resume with ckpt_path=last, and the
launchers (python with multirun, Lightning's DDP launcher, torchrun)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from lightning_sharding.loading.audit import audit
from lightning_sharding.train import CONF_DIR, run
from tests.support.harness import ROOT, free_port

pytestmark = pytest.mark.timeout(300)

QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "logger=none"]
# Tiny data for each recipe: (overrides, samples per epoch).
TINY: dict[str, tuple[list[str], int]] = {
    "climate": (
        ["data.months=3", "data.steps_per_month=100", "data.window=8", "data.stride=4", "data.batch_size=8"],
        74,
    ),
    "tokens": (["data.num_files=2", "data.tokens_per_file=1000", "data.sample_length=15", "data.batch_size=8"], 124),
    "sqlite": (["data.rows=120", "data.batch_size=16"], 120),
    "webdataset": (["data.num_items=3", "data.samples_per_item=40", "data.batch_size=16"], 120),
    "parquet": (["data.num_items=3", "data.samples_per_item=40", "data.batch_size=16"], 120),
    "npy": (["data.num_items=3", "data.samples_per_item=40", "data.batch_size=16"], 120),
    "jsonl": (["data.num_items=3", "data.samples_per_item=40", "data.batch_size=16"], 120),
    "images": (["data.num_items=2", "data.samples_per_item=20", "data.image_size=32", "data.crop=24"], 40),
    "anneal": (  # the mixture's three streams, small, under the recipe's two-phase schedule
        ["data.samples_per_epoch=96", "data.batch_size=16", "data.streams.0.num_items=2"]
        + [f"data.streams.{i}.samples_per_item={n}" for i, n in enumerate((32, 32, 16))],
        96,
    ),
}


def make(tmp_path: Path, *overrides: str, config_dir: str = CONF_DIR, name: str = "train") -> DictConfig:
    common = [f"out_dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}", *QUIET]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(name, overrides=[*common, *overrides])


def test_the_main_job_trains_the_synthetic_set_and_reports_every_epoch(tmp_path: Path) -> None:
    overrides = ["data.num_items=4", "data.samples_per_item=50", "data.batch_size=16", "data.num_workers=0"]
    result = run(make(tmp_path, *overrides, "data.seed=3"))
    assert [e["consumed"] for e in result["epochs"]] == [200, 200]
    assert result["seed"] == 3 and result["world_size"] == 1
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.processes
@pytest.mark.parametrize("recipe", sorted(TINY))
def test_every_recipe_generates_its_data_and_trains(tmp_path: Path, recipe: str) -> None:
    overrides, total = TINY[recipe]
    # One spawned worker for the strategies with processes of their own, in-process for the rest (time).
    workers = ["data.num_workers=1"] if recipe == "climate" else []
    workers = workers or ["data.num_workers=0"]
    cfg = make(tmp_path, f"recipe={recipe}", *overrides, *workers, "trainer.max_epochs=1", "data.seed=5")
    result = run(cfg)
    assert [e["consumed"] for e in result["epochs"]] == [total]
    assert list((tmp_path / "cache" / "datasets").iterdir()), "the recipe wrote no data set"


def test_a_mixture_controller_from_the_config_decides_the_shares_and_the_checkpoint_keeps_them(
    tmp_path: Path,
) -> None:
    """``callbacks.mixture_controller.every_n_steps=2`` with ``recipe=mixture``: the regressor hands
    its per-stream losses to an ExcessLossWeights controller; its decisions are in the checkpoint."""
    import torch

    tiny = ["data.samples_per_epoch=96", "data.batch_size=16", "data.streams.0.num_items=2"]
    tiny += [f"data.streams.{i}.samples_per_item={n}" for i, n in enumerate((32, 32, 16))]
    control = ["callbacks.mixture_controller.every_n_steps=2", "callbacks.mixture_controller.lr=5"]
    cfg = make(tmp_path, "recipe=mixture", *tiny, *control, "data.num_workers=0", "trainer.max_epochs=2")
    result = run(cfg)
    assert [e["consumed"] for e in result["epochs"]] == [96, 96]
    ledger = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["lightning_sharding"]
    assert [d["step"] for d in ledger["decisions"]] == [2, 4, 6, 8, 10, 12]
    assert all(abs(sum(d["shares"].values()) - 1) < 1e-9 for d in ledger["decisions"])


def test_recipe_pretrain_trains_packed_documents_and_prints_their_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """recipe=pretrain: two generated token streams, one at a share in tokens and one drawn once,
    packed into sequences for a causal transformer; the summary gives each stream's sequences, and
    the one drawn once draws every sequence of its corpus."""
    from lightning_sharding.tokens import IndexedTokens

    streams = "data.streams=[{name:web,documents:60,longest:50,tokens:1000},{name:code,documents:20,longest:30}]"
    overrides = [streams, "data.seq_len=32", "data.batch_size=8", "data.num_workers=0"]
    result = run(make(tmp_path, "recipe=pretrain", *overrides, "trainer.max_epochs=1", "data.seed=5"))
    code = next(p for p in (tmp_path / "cache" / "datasets").iterdir() if "-code-" in p.name)
    corpus = IndexedTokens(str(code / "part-*.idx"))
    code_sequences = -(-int(corpus.lengths(corpus.items()).sum()) // 32)
    out = capsys.readouterr().out
    summary = (
        r"packed streams, 'concat', seq_len 32, an epoch: web (\d+) sequences \(tokens=1000; "
        r".*code (\d+) sequences \(repeat=1.0; it holds (\d+) sequences"
    )
    line = re.search(summary, out)
    assert line is not None, out
    web, code_drawn, code_total = (int(g) for g in line.groups())
    assert code_drawn == code_total == code_sequences and abs(web * 32 - 1000) <= 32
    assert [e["consumed"] for e in result["epochs"]] == [web + code_drawn]


def test_tokens_outside_the_vocabulary_are_named_with_the_file(tmp_path: Path) -> None:
    import numpy as np

    from lightning_sharding.strategies import SampleError

    (tmp_path / "tok").mkdir()
    np.save(tmp_path / "tok" / "a.npy", np.arange(400, dtype=np.int32) % 100)  # tokens 0..99
    overrides = [f"data.urls=[{tmp_path}/tok/*.npy]", "data.vocab_size=50", "data.sample_length=15"]
    cfg = make(tmp_path, "recipe=tokens", *overrides, "data.batch_size=8", "data.num_workers=0")
    with pytest.raises(SampleError, match=r"a\.npy.*token \d+ is outside data\.vocab_size=50"):
        run(cfg)


# The loopback server of each store, and the credentials its filesystem takes from the command line.
STORES = {
    "s3": (
        "s3_server",
        "+data.storage_options={key: testing, secret: testing, client_kwargs: {region_name: us-east-1}}",
    ),
    "gs": ("gcs_server", "+data.storage_options={token: anon, project: test}"),
}


@pytest.mark.processes
@pytest.mark.parametrize("store", list(STORES))
def test_the_webdataset_recipe_reads_tar_shards_from_a_bucket(
    tmp_path: Path, request: pytest.FixtureRequest, store: str
) -> None:
    """recipe=webdataset_s3 over s3:// or gs:// URLs: data.endpoint_url goes where that store's
    filesystem takes it, and is refused for local paths."""
    from lightning_sharding.recipes.synthetic_files import write_regression

    fixture, credentials = STORES[store]
    server = request.getfixturevalue(fixture)
    bucket = server.bucket("recipe-shards")
    write_regression(f"{bucket}/train", "tar", [40, 40, 40], dim=16, storage_options=server.storage_options)
    overrides = [
        "recipe=webdataset_s3",
        f"data.urls=[{bucket}/train/part-*.tar]",
        f"data.endpoint_url={server.endpoint}",
        credentials,
        "data.batch_size=16",
        "data.num_workers=1",
        "trainer.max_epochs=1",
    ]
    result = run(make(tmp_path, *overrides))
    assert [e["consumed"] for e in result["epochs"]] == [120]
    assert not (tmp_path / "cache" / "datasets").exists(), "given urls, nothing is generated"
    local = [f"data.urls=[{tmp_path}/*.tar]", f"data.endpoint_url={server.endpoint}"]
    with pytest.raises(
        Exception, match=r"endpoint_url=.* sets the endpoint of s3:// or gs:// URLs, and data.urls has file://"
    ):
        run(make(tmp_path, overrides[0], *local))


@pytest.mark.processes
def test_ckpt_path_last_resumes_the_run_on_another_number_of_workers(tmp_path: Path) -> None:
    """tokens: stop after 4 steps (0 workers), resume from the newest checkpoint with 1 worker."""
    overrides, total = TINY["tokens"]
    first = make(tmp_path, "recipe=tokens", *overrides, "data.num_workers=0", "checkpoint_every_n_steps=2")
    first.trainer.max_steps = 4
    assert run(first)["epochs"][0]["consumed"] == 4 * 8
    then = make(tmp_path, "recipe=tokens", *overrides, "ckpt_path=last", "data.num_workers=1")
    result = run(then)
    assert result["ckpt_path"] == str(tmp_path / "checkpoints" / "last.ckpt")
    assert [e["consumed"] for e in result["epochs"]] == [total]  # the first 32 samples were not served again
    assert result["epochs"][0]["served_this_run"] == total - 32


def test_a_recipe_of_your_own_next_to_the_packaged_ones(tmp_path: Path) -> None:
    """The README's 'Write your own recipe': copy a packaged recipe into my_conf/recipe/, edit it,
    and point it at your files."""
    import numpy as np

    from lightning_sharding.recipes.climate import write_months

    (tmp_path / "era5").mkdir()
    write_months(tmp_path / "era5", months=2, steps=60, variables=4)
    mine = tmp_path / "my_conf" / "recipe"
    mine.mkdir(parents=True)
    text = (Path(CONF_DIR) / "recipe" / "climate.yaml").read_text()
    text = text.replace("  window: 48", f"  paths: [{tmp_path}/era5/*.npy]\n  variables: 4\n  window: 12")
    (mine / "my_climate.yaml").write_text(text)
    search = f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]"  # what --config-dir my_conf does
    cfg = make(tmp_path, search, "recipe=my_climate", "data.batch_size=8", "data.num_workers=0", "trainer.max_epochs=1")
    assert run(cfg)["epochs"][0]["consumed"] == (120 - 12) // 6 + 1
    assert np.load(tmp_path / "era5" / "2000-01.npy").shape == (60, 4)


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _consumed(stdout: str, samples: int) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(rf"^\s+\d+\s+{samples}\s+(\d+)\s", stdout, flags=re.M)]


@pytest.mark.processes
def test_the_tokens_recipe_under_torchrun_on_two_ranks(tmp_path: Path) -> None:
    """The train entry under `torchrun --nproc_per_node=2` (trainer=ddp_cpu: devices 2, strategy ddp),
    with 1 worker a rank (this launch also stands for the plain train entry under torchrun that
    tests/process/test_elastic.py started with the synthetic data)."""
    overrides, total = TINY["tokens"]
    env = _env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={env['MASTER_PORT']}"]
    cmd += ["-m", "lightning_sharding.train", "recipe=tokens", "trainer=ddp_cpu", *overrides]
    cmd += ["data.num_workers=1"]
    cmd += [f"out_dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}", *QUIET]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "world 2 rank(s) x 1 worker(s)" in proc.stdout
    assert "rank 0 = node 0 local 0 | rank 1 = node 0 local 1" in proc.stdout
    assert _consumed(proc.stdout, total) == [total]


@pytest.mark.processes
def test_a_config_dir_of_your_own_under_lightnings_launcher(tmp_path: Path) -> None:
    """recipes/ddp_cpu.yaml: 2 DDP ranks started by Lightning's own launcher (1 worker each, for time).
    This launch also stands for the train entry with trainer.devices=2 trainer.strategy=ddp under
    Lightning's launcher (what ddp_cpu sets), which tests/process/test_elastic.py started on its own."""
    cmd = [sys.executable, "-m", "lightning_sharding.train", "--config-dir", str(ROOT / "recipes")]
    cmd += ["--config-name", "ddp_cpu", "data.num_items=2", "data.samples_per_item=64", "trainer.max_epochs=1"]
    cmd += ["data.num_workers=1", f"out_dir={tmp_path}", *QUIET]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "world 2 rank(s) x 1 worker(s)" in proc.stdout
    assert "rank 0 = node 0 local 0 | rank 1 = node 0 local 1" in proc.stdout
    assert _consumed(proc.stdout, 128) == [128]


@pytest.mark.processes
def test_multirun_keeps_every_jobs_checkpoints_apart(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "lightning_sharding.train", "-m", "data.batch_size=8,16", "data.num_items=3"]
    cmd += ["data.samples_per_item=40", "data.num_workers=0", "trainer.max_epochs=1", f"out_dir={tmp_path}", *QUIET]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert _consumed(proc.stdout, 120) == [120, 120]
    assert "batch 8," in proc.stdout and "batch 16," in proc.stdout
    (sweep,) = (tmp_path / "multirun").iterdir()
    assert sorted(p.parent.parent.name for p in sweep.glob("*/checkpoints/last.ckpt")) == ["0", "1"]
    assert not (tmp_path / "checkpoints").exists()


def test_the_packaged_config_needs_no_repository(tmp_path: Path) -> None:
    """recipe=NAME resolves from the installed package: a copy of the package alone composes it."""
    copy = tmp_path / "site" / "lightning_sharding"
    shutil.copytree(ROOT / "lightning_sharding", copy, ignore=shutil.ignore_patterns("__pycache__"))
    code = "from lightning_sharding.config import CONF_DIR; print(CONF_DIR)"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    conf = Path(proc.stdout.strip())
    assert conf == copy / "conf" and (conf / "recipe" / "climate.yaml").is_file()


@pytest.mark.processes
def test_one_command_starts_a_run_and_after_a_sigkill_resumes_it(tmp_path: Path) -> None:
    """The same `lightning-sharding-train ... ckpt_path=last` command as a cluster requeues it: the
    first launch finds no checkpoint, warns and starts fresh, and is SIGKILLed once checkpoints are
    written; the same command resumes from the newest. Then a checkpoint named as ModelCheckpoint
    names it (`epoch=0-step=2.ckpt`) resumes given as written."""
    total = 4 * 300
    base = [sys.executable, "-m", "lightning_sharding.train", "data.num_items=4", "data.samples_per_item=300"]
    base += ["data.batch_size=4", "data.num_workers=0", "data.seed=5", "checkpoint_every_n_steps=2"]
    base += ["trainer.max_epochs=1", "audit.enabled=true", f"out_dir={tmp_path}", *QUIET]
    command = [*base, "ckpt_path=last"]
    checkpoints = tmp_path / "checkpoints"
    log = tmp_path / "first.log"
    with open(log, "w") as sink:
        first = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path, env=_env())
        deadline = time.time() + 120
        while time.time() < deadline and first.poll() is None and len(list(checkpoints.glob("epoch=*.ckpt"))) < 2:
            time.sleep(0.01)
        first.kill()  # SIGKILL, as a preemption that gives no time
        first.wait(timeout=30)
    said = log.read_text()
    assert first.returncode == -9, f"the first launch was not killed mid-epoch (it ended {first.returncode}):\n{said}"
    assert "ckpt_path=last: no checkpoint in" in said and "starts from scratch" in said, said[-3000:]
    written = sorted(checkpoints.glob("epoch=*.ckpt"), key=lambda p: p.stat().st_mtime_ns)
    requeued = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=_env())
    assert requeued.returncode == 0, (requeued.stdout + requeued.stderr)[-3000:]
    assert "starts from scratch" not in requeued.stdout + requeued.stderr
    assert _consumed(requeued.stdout, total) == [total]
    assert f"Restoring states from the checkpoint path at {checkpoints}" in requeued.stdout + requeued.stderr
    (row,) = audit([tmp_path])  # the killed run's kept steps and the requeued run's: each sample once
    assert (row.consumed, row.duplicates, row.missing, row.complete) == (total, 0, 0, True)
    oldest = written[0]  # a name with '=' signs, as ModelCheckpoint wrote it
    assert "=" in oldest.name
    given = subprocess.run(
        [*base, f"ckpt_path={oldest}"], capture_output=True, text=True, timeout=240, cwd=tmp_path, env=_env()
    )
    assert given.returncode == 0, (given.stdout + given.stderr)[-3000:]
    assert _consumed(given.stdout, total) == [total]


@pytest.mark.processes
def test_a_user_error_prints_one_line_and_how_to_see_the_traceback(tmp_path: Path) -> None:
    """A missing path, a corrupt sample (read in a DataLoader worker) and a bad value: each ends the
    command with the package's one line and the hint, and no traceback; HYDRA_FULL_ERROR=1 shows it."""
    from lightning_sharding.recipes.synthetic_files import write_regression

    data = tmp_path / "data"
    write_regression(str(data), "jsonl", [16, 16], dim=16)
    part = data / "part-00000.jsonl"
    lines = part.read_text().splitlines()
    lines[5] = '{"id": 5, "x": [0.1, 0.2'  # cut short
    part.write_text("\n".join(lines) + "\n")
    files = ["data=files", "data.format=jsonl", "data.batch_size=4", "trainer.max_epochs=1"]
    cases = {
        "missing path": ([f"data.urls=[{tmp_path}/nowhere/*.jsonl]", "data.num_workers=0"], "no file matches"),
        "corrupt sample": (
            [f"data.urls=[{data}/*.jsonl]", "data.num_workers=1"],
            "line 6 (sample 5) is not valid JSON",
        ),
        "bad value": ([f"data.urls=[{data}/*.jsonl]", "data.batch_size=-4"], "batch_size=-4"),
    }
    base = [sys.executable, "-m", "lightning_sharding.train", *files, f"out_dir={tmp_path}", *QUIET]
    for case, (overrides, message) in cases.items():
        done = subprocess.run(
            [*base, *overrides], capture_output=True, text=True, timeout=240, cwd=tmp_path, env=_env()
        )
        assert done.returncode == 1, (case, done.stdout[-2000:], done.stderr[-2000:])
        errors = [line for line in done.stderr.splitlines() if line.startswith("lightning-sharding-train: error: ")]
        assert len(errors) == 1 and message in errors[0], (case, done.stderr[-3000:])
        assert "(run again with HYDRA_FULL_ERROR=1 to see the traceback)" in done.stderr, case
        assert "Traceback (most recent call last)" not in done.stderr, (case, done.stderr[-3000:])
    full = subprocess.run(
        [*base, *cases["bad value"][0]],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env={**_env(), "HYDRA_FULL_ERROR": "1"},
    )
    assert full.returncode == 1 and "Traceback (most recent call last)" in full.stderr
