"""How DataLoader workers start by default: from a forkserver that imported torch, the package, the
reader's module and the training script's imports once, and that shares no memory with the training
process. The server is a fresh interpreter started by the loader (``strategies/_start.py``), so
nothing the training process holds (a CUDA context, a lock taken by one of its threads, a changed
global) reaches a worker; under ``fork`` all of it would. Real processes throughout: a training
process started with ``python``, real workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import ROOT

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]

SCRIPT = textwrap.dedent(
    """
    import colorsys  # noqa: F401 - not a package known to be safe at import: not preloaded
    import json, os, sys

    import numpy  # noqa: F401 - a heavy package known to be safe: the server preloads it

    from lightning_sharding.core.ledger import Ledger

    from lightning_sharding.core.manifest import Manifest

    from lightning_sharding.core.world import World
    from lightning_sharding.strategies.options import LoaderOptions
    from lightning_sharding.strategies.shard import ShardedLoader
    from tests.support.data import worker_probe


    def samples(method):
        reader = worker_probe.ProbeReader()
        manifest = Manifest.from_items(reader.items())
        ledger = Ledger(seed=1, total=manifest.total, manifest=manifest.summary())
        options = LoaderOptions(batch_size=4, num_workers=2, multiprocessing_context=method, shuffle=False)
        loader = ShardedLoader.build(reader, manifest, ledger, world=World(0, 1), options=options)
        out = []
        for batch in loader:
            keys = ("id", "pid", "ppid", "lock_free", "gc_enabled", "gc_frozen")
            for i in range(len(batch["id"])):
                out.append({k: int(batch[k][i]) for k in keys} | {"marker": batch["marker"][i]})
        loader.close()
        return out


    if __name__ == "__main__":
        method = None if sys.argv[1] == "default" else sys.argv[1]
        worker_probe.MARKER = "changed by the training process"
        worker_probe.LOCK.acquire()  # held by the training process while its workers read
        rows = samples(method)
        servers = sorted({r["ppid"] for r in rows} - {os.getpid()})
        preloaded = [open(f"/proc/{p}/cmdline").read() for p in servers]
        # A process forked from this one (Lightning's ddp_fork ranks are) starts workers of its own.
        child = os.fork()
        if child == 0:
            os._exit(0 if sorted(r["id"] for r in samples(method)) == list(range(16)) else 3)
        _, status = os.waitpid(child, 0)
        print(json.dumps({"rows": rows, "preloaded": preloaded, "me": os.getpid(), "forked_child": status}))
    """
)


def run_probe(tmp_path: Path, method: str) -> dict[str, Any]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), method], env=env, capture_output=True, text=True, timeout=150, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_default_workers_come_from_a_preloaded_forkserver_that_shares_no_memory_with_training(tmp_path: Path) -> None:
    probe = run_probe(tmp_path, "default")
    rows = probe["rows"]
    assert sorted(r["id"] for r in rows) == list(range(16))
    # The workers' parent is the forkserver, not the training process.
    assert len(probe["preloaded"]) == 1 and all(r["ppid"] != probe["me"] for r in rows)
    server = probe["preloaded"][0]
    assert "multiprocessing.forkserver" in server, server
    for module in ("torch", "lightning_sharding.strategies.shard", "tests.support.data.worker_probe", "numpy"):
        assert f"'{module}'" in server, f"{module} is not preloaded: {server}"
    assert "'colorsys'" not in server, "a module of the script outside the known-safe packages was preloaded"
    # The collector paused while the server imported, then froze what the imports made and ran again:
    # a worker collects, and its collections skip torch's objects (about a million).
    preload = server[server.index("[") : server.index("]") + 1]
    assert preload.startswith("['lightning_sharding.preload.pause'"), preload
    assert preload.endswith("'lightning_sharding.preload.resume']"), preload
    assert all(r["gc_enabled"] for r in rows)
    assert min(r["gc_frozen"] for r in rows) > 100_000, {r["gc_frozen"] for r in rows}
    # Nothing of the training process's memory: the global as imported, the lock free.
    assert {r["marker"] for r in rows} == {"as imported"}
    assert all(r["lock_free"] for r in rows)
    assert probe["forked_child"] == 0, "a process forked from the training process could not start workers"


def test_fork_workers_inherit_the_training_process_memory(tmp_path: Path) -> None:
    """The same probe under ``fork``: the workers are the training process's children and see its
    changed global and its held lock (which is why fork is not the default)."""
    probe = run_probe(tmp_path, "fork")
    rows = probe["rows"]
    assert sorted(r["id"] for r in rows) == list(range(16))
    assert {r["ppid"] for r in rows} == {probe["me"]} and probe["preloaded"] == []
    assert {r["marker"] for r in rows} == {"changed by the training process"}
    assert not any(r["lock_free"] for r in rows)
    assert all(r["gc_enabled"] for r in rows) and {r["gc_frozen"] for r in rows} == {0}, "only a server freezes"
    assert probe["forked_child"] == 0


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path: Path) -> None:
    """A forkserver (or spawned) worker runs the script's top level again: without
    ``if __name__ == "__main__":`` it would start training there. It stops, saying what to do."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            """
            from lightning_sharding import SyntheticReader
            from lightning_sharding.core.ledger import Ledger
            from lightning_sharding.core.manifest import Manifest
            from lightning_sharding.core.world import World
            from lightning_sharding.strategies.options import LoaderOptions
            from lightning_sharding.strategies.shard import ShardedLoader

            reader = SyntheticReader(num_items=2, samples_per_item=8)
            manifest = Manifest.from_items(reader.items())
            ledger = Ledger(seed=1, total=manifest.total, manifest=manifest.summary())
            options = LoaderOptions(batch_size=4, num_workers=1)
            loader = ShardedLoader.build(reader, manifest, ledger, world=World(), options=options)
            print(sum(len(b["id"]) for b in loader))
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode != 0, done.stdout
    assert 'put the code that trains under `if __name__ == "__main__":`' in done.stderr, done.stderr[-3000:]
