"""A Fabric loop and a ``torchrun`` + DCP loop over ``ShardedData`` never import Lightning's Trainer
package: the loading engine (``lightning_sharding.loading``) imports no Lightning, and only the
DataModule adapter does. Real processes: Fabric's own launcher and real ``torchrun``, 2 ranks x 2
workers over gloo, a save and a load of the state (tests/jobs/lightning_free_job.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.harness import ROOT, Topology, job_env, launch

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

JOB = ROOT / "tests" / "jobs" / "lightning_free_job.py"
STEPS, BATCH, RANKS = 3, 4, 2  # the job's


@pytest.mark.parametrize("launcher", ["fabric", "torchrun"])
def test_a_loop_of_its_own_over_sharded_data_leaves_lightning_out_of_sys_modules(tmp_path: Path, launcher: str) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"launcher": launcher, "out": str(tmp_path)}))
    topology = Topology(world_size=RANKS, launcher="torchrun" if launcher == "torchrun" else "ddp")
    returncode, output = launch(topology, config, job_env(), job=JOB)
    assert returncode == 0, output[-5000:]
    for rank in range(RANKS):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["lightning"] == [], f"rank {rank} imported {report['lightning'][:10]}"
        assert report["fabric"] == (launcher == "fabric")
        # The state saved after STEPS steps, loaded into a new ShardedData: every rank's batches of them.
        assert report["consumed"] == STEPS * BATCH * RANKS
