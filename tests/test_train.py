"""The Hydra entry: compose the real config, run the main job, refuse misspelt keys."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from lightning_sharding.train import CONF_DIR, run

pytestmark = pytest.mark.timeout(300)


def test_run_trains_the_synthetic_job_and_reports_every_epoch(tmp_path: Path) -> None:
    overrides = [
        "data.num_items=4",
        "data.samples_per_item=50",
        "data.batch_size=16",
        "data.num_workers=0",
        "data.seed=3",
        "trainer.enable_progress_bar=false",
        f"out_dir={tmp_path}",
    ]
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="train", overrides=overrides)
    result = run(cfg)
    assert [e["consumed"] for e in result["epochs"]] == [200, 200]
    assert result["seed"] == 3 and result["world_size"] == 1


@pytest.mark.parametrize(
    ("override", "key"), [("data.batch_sise=8", "batch_sise"), ("data.num_workers=two", "num_workers")]
)
def test_a_misspelt_key_or_wrong_type_fails_at_compose_time(override: str, key: str) -> None:
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        with pytest.raises(ConfigCompositionException) as err:
            compose(config_name="train", overrides=[override])
    assert key in str(err.value) + str(err.value.__cause__)


@pytest.mark.processes
def test_the_console_entry_prints_the_summary(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "lightning_sharding.train",
        "data.num_items=3",
        "data.samples_per_item=40",
        "data.num_workers=1",
        "data.multiprocessing_context=spawn",
        "trainer.max_epochs=1",
        "trainer.enable_progress_bar=false",
        f"out_dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lightning_sharding summary" in proc.stdout
    assert "      120       120" in proc.stdout  # samples and consumed of epoch 0


@pytest.mark.processes
def test_the_ddp_cpu_recipe_runs_on_two_ranks(tmp_path: Path) -> None:
    from tests.harness import ROOT, free_port

    cmd = [sys.executable, "-m", "lightning_sharding.train", "--config-dir", str(ROOT / "recipes")]
    cmd += ["--config-name", "ddp_cpu", "data.num_items=2", "data.samples_per_item=64", "trainer.max_epochs=1"]
    cmd += ["data.multiprocessing_context=spawn", "trainer.enable_progress_bar=false", f"out_dir={tmp_path}"]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "world 2 rank(s) x 2 worker(s)" in proc.stdout
    assert "      128       128" in proc.stdout


@pytest.mark.parametrize("recipe", ["webdataset", "parquet", "npy", "jsonl"])
def test_every_reader_recipe_generates_its_data_and_trains(tmp_path: Path, recipe: str) -> None:
    from tests.harness import ROOT

    overrides = [
        "data.num_items=3",
        "data.samples_per_item=40",
        "data.num_workers=0",
        "data.batch_size=16",
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.max_epochs=1",
        "trainer.enable_progress_bar=false",
        f"out_dir={tmp_path}",
        f"hydra.searchpath=[file://{CONF_DIR}]",  # where a recipe's `defaults: [train]` comes from
    ]
    with initialize_config_dir(config_dir=str(ROOT / "recipes"), version_base=None):
        cfg = compose(config_name=recipe, overrides=overrides)
    result = run(cfg)
    assert [e["consumed"] for e in result["epochs"]] == [120]
    assert list((tmp_path / "cache" / "datasets").iterdir()), "the recipe wrote no data set"
