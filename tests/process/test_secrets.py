"""Credentials are never persisted or printed: a planted secret is found nowhere the job wrote.

Two recognisable secrets go into a real ``lightning-sharding-train`` job over a real object store on
loopback (moto, reached over HTTP): one in ``storage_options`` (a header the HTTP filesystem sends)
and one in the data URLs (a signed URL's query token). Both come from the environment through
Hydra's ``${oc.env:...}``, as the Security page advises. The job fails once on purpose (a missing
object, named in the error), then trains with checkpoints and the audit trail, resumes with the
URLs signed again (another token), and ``inspect`` and ``audit`` read what it wrote. Every file
under the run directory (the checkpoints, the audit trail, Hydra's ``.hydra`` folder, the caches)
and every captured line of output is scanned.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.process.test_train import QUIET, _env
from tests.support.s3 import S3Server

URL_SECRET = "PlantedUrlToken9c1e7"
FRESH_URL_SECRET = "PlantedFreshToken3a5f0"  # the same files signed again, for the resume
OPTION_SECRET = "PlantedHeaderKey4b2d8"
SECRETS = (URL_SECRET, FRESH_URL_SECRET, OPTION_SECRET)


def upload_shards(server: S3Server, count: int) -> list[str]:
    """``count`` tar shards of the regression set in a bucket, readable over plain HTTP; their HTTP URLs."""
    from lightning_sharding.recipes.synthetic_files import write_regression

    bucket = server.bucket("secret-shards")
    urls = write_regression(f"{bucket}/train", "tar", [24] * count, dim=16, storage_options=server.storage_options)
    client = server.client()
    for url in urls:
        client.put_object_acl(Bucket="secret-shards", Key=url.split("secret-shards/", 1)[1], ACL="public-read")
    return [url.replace("s3://", f"{server.endpoint}/") for url in urls]


def train(tmp_path: Path, urls: list[str], *extra: str, token: str = URL_SECRET) -> subprocess.CompletedProcess[str]:
    signed = ",".join(f"'{u}?X-Amz-Signature=${{oc.env:LSH_URL_TOKEN}}'" for u in urls)
    cmd = [sys.executable, "-m", "lightning_sharding.train", "data=files", "data.format=tar", f"data.urls=[{signed}]"]
    cmd += ["+data.storage_options={client_kwargs: {headers: {X-Api-Key: '${oc.env:LSH_API_KEY}'}}}"]
    cmd += ["data.batch_size=8", "data.num_workers=1", "trainer.max_epochs=1"]
    cmd += ["checkpoint_every_n_steps=2", "audit.enabled=true", f"out_dir={tmp_path / 'run'}"]
    cmd += [f"data.cache_dir={tmp_path / 'run' / 'cache'}", *QUIET, *extra]
    env = {**_env(), "LSH_URL_TOKEN": token, "LSH_API_KEY": OPTION_SECRET}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)


def found_secrets(text: str | bytes) -> list[str]:
    data = text.encode() if isinstance(text, str) else text
    return [s for s in SECRETS if s.encode() in data]


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_planted_secret_is_nowhere_the_job_wrote_or_printed(tmp_path: Path, s3_server: S3Server) -> None:
    urls = upload_shards(s3_server, 3)
    failed = train(tmp_path, [*urls, urls[0].replace("part-", "missing-")])
    assert failed.returncode != 0, failed.stdout[-2000:]
    assert "missing-00000.tar?X-Amz-Signature=REDACTED' does not exist" in failed.stderr, failed.stderr[-3000:]

    trained = train(tmp_path, urls)
    assert trained.returncode == 0, (trained.stdout + trained.stderr)[-4000:]
    assert "72" in trained.stdout  # the summary: 3 shards of 24 samples consumed
    checkpoints = sorted((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    assert checkpoints, "the run wrote no checkpoint"
    # Signed again (another token), the same files resume: the checkpoint knows them by name and content.
    resumed = train(tmp_path, urls, "ckpt_path=last", "trainer.max_epochs=2", token=FRESH_URL_SECRET)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert "written for other data" not in resumed.stderr
    cli = [sys.executable, "-m", "lightning_sharding.cli"]
    tools = [
        subprocess.run([*cli, "inspect", str(checkpoints[-1])], capture_output=True, text=True, timeout=120),
        subprocess.run([*cli, "audit", str(tmp_path / "run" / "audit")], capture_output=True, text=True, timeout=120),
    ]
    assert all(t.returncode == 0 for t in tools), [t.stdout + t.stderr for t in tools]
    assert "X-Amz-Signature=REDACTED" in tools[0].stdout, tools[0].stdout  # the data's first key, shown redacted

    written = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    kinds = {p.suffix for p in written}
    assert {".ckpt", ".jsonl", ".yaml"} <= kinds, f"the scan must see checkpoints, audit files and Hydra's: {kinds}"
    leaks = {str(p.relative_to(tmp_path)): found_secrets(p.read_bytes()) for p in written}
    outputs = {
        "failed run": failed.stdout + failed.stderr,
        "trained run": trained.stdout + trained.stderr,
        "resumed run": resumed.stdout + resumed.stderr,
        "inspect": tools[0].stdout + tools[0].stderr,
        "audit": tools[1].stdout + tools[1].stderr,
    }
    leaks.update({name: found_secrets(text) for name, text in outputs.items()})
    assert not {where: s for where, s in leaks.items() if s}, f"secrets found in {len(written)} files and the outputs"
