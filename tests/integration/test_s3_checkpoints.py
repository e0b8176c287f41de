"""Checkpoints in object storage: real runs (`paramserver run`) with `--checkpoint-dir s3://...`
against a real S3-compatible server (moto, in a process of its own), reached through s3fs in
every process (PS, workers, the CLI) by the environment alone (AWS_ENDPOINT_URL and keys).

Written checkpoints are listed, verified, byte-for-byte those of the same run on a local
directory, and export to the values the worker ended with; a PS killed while its shard file's
PUT is in flight leaves no manifest and no object for that file, `checkpoint list` shows the
complete ones only, and `--resume` continues from the previous one to the uninterrupted end.
Unfinished multipart uploads under the directory are aborted, and a store sees what other
processes committed after it listed (s3fs caches listings by default).
"""

import dataclasses
import json

import pytest
import torch
from tests.fault.launcher_run import LauncherRun
from tests.integration.s3_server import S3Server
from tests.integration.test_checkpoints import RESUME, cli, export_file, run, same_end

from paramserver.checkpoint.store import CheckpointStore

pytestmark = pytest.mark.cluster  # an S3 server and launcher runs: three short clusters per test, ~25-30 s each

s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[s3]')")
pytest.importorskip("moto.server", reason="moto's server is not installed (pip install 'moto[server]')")

BUCKET = "paramserver-test"
URL = f"s3://{BUCKET}/run1"


@pytest.fixture
def s3(monkeypatch):
    """Starts an S3 server (`hold`: see S3Server) with a bucket, and points this process and
    every process it starts at it; the server is killed at teardown."""
    servers = []

    def start(hold: str | None = None) -> S3Server:
        servers.append(server := S3Server(hold))
        for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
            monkeypatch.delenv(name, raising=False)
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        s3fs.S3FileSystem.clear_instance_cache()  # an instance of an earlier test knows an earlier endpoint
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(BUCKET)
        return server

    yield start
    for server in servers:
        server.stop()
    s3fs.S3FileSystem.clear_instance_cache()


def listed(url: str) -> list[tuple[str, str]]:
    result = cli("list", url)
    assert result.returncode == 0, result.stderr
    return [(row["name"], row["status"]) for row in map(json.loads, result.stdout.splitlines())]


def digests(store: CheckpointStore, name: str) -> list[tuple[str, int, str]]:
    return [(entry.file, entry.bytes, entry.sha256) for entry in store.shard_files(name, store.manifest(name))]


def test_checkpoints_written_to_s3_are_those_of_a_local_run_and_export_the_trained_values(procs, s3, tmp_path):
    s3()
    local = str(tmp_path / "ckpt")
    on_s3 = run(procs, 2, "--checkpoint-dir", URL, "--checkpoint-every", "10", steps=20)
    on_disk = run(procs, 2, "--checkpoint-dir", local, "--checkpoint-every", "10", steps=20)
    same_end(on_s3, on_disk)
    assert listed(URL) == [("ckpt-000000010", "ok"), ("ckpt-000000020", "ok")]  # each file hashed back from S3
    remote, here = CheckpointStore(URL), CheckpointStore(local)
    for name in ("ckpt-000000010", "ckpt-000000020"):  # one seeded worker: the very same bytes, wherever stored
        assert digests(remote, name) == digests(here, name)
        assert remote.fs.cat_file(remote.path(name, "shard-1.safetensors")) == \
            (tmp_path / "ckpt" / name / "shard-1.safetensors").read_bytes()
    inspected = json.loads(cli("inspect", URL).stdout)
    assert inspected["name"] == "ckpt-000000020" and inspected["shards"] == 2
    assert inspected["variables"] == json.loads(cli("inspect", local).stdout)["variables"]

    saved, _ = export_file(URL, tmp_path / "s3.pt")
    reference, _ = export_file(local, tmp_path / "local.pt")
    assert saved["step"] == 20 and list(saved["state_dict"]) == list(reference["state_dict"])
    assert all(torch.equal(saved["state_dict"][k], reference["state_dict"][k]) for k in reference["state_dict"])
    dense = sum(t.double().sum().item() for t in saved["state_dict"].values())
    assert dense == pytest.approx(on_s3["dense_checksum"], abs=1e-5)  # the values the worker pulled at its end
    table = saved["embeddings"]["resume.table"]
    assert table["weight"].double().abs().sum().item() == pytest.approx(on_s3["table_checksum"], abs=1e-5)
    assert procs.leftovers() == []


def test_a_ps_killed_mid_write_to_s3_leaves_no_manifest_and_resume_takes_the_previous_checkpoint(procs, s3,
                                                                                                  thirty_steps_written):
    server = s3(hold="/ckpt-000000020/shard-1.safetensors")
    crashed = LauncherRun(procs, ["--ps", "2", "--workers", "1", "--max-restarts", "0", "--checkpoint-dir", URL,
                                  "--checkpoint-every", "10"], RESUME, ["--steps", "30"])
    server.wait_for("HELD")  # ps1's PUT of its file of ckpt-000000020 is in flight, unanswered
    assert listed(URL) == [("ckpt-000000010", "ok")]
    crashed.kill("ps1")
    assert crashed.proc.wait(180) != 0, crashed.output()  # no restarts left: the run ends
    store = CheckpointStore(URL)
    assert store.complete() == ["ckpt-000000010"] and listed(URL) == [("ckpt-000000010", "ok")]
    assert not store.fs.exists(store.path("ckpt-000000020", "MANIFEST.json"))
    assert not store.fs.exists(store.path("ckpt-000000020", "shard-1.safetensors"))  # a PUT is all or nothing
    # what may stay: ps0's file (its PUT completed), ignored without a manifest, overwritten when
    # ckpt-000000020 is written again, else deleted by retention
    assert set(store.fs.find(store.path("ckpt-000000020"))) <= {store.path("ckpt-000000020", "shard-0.safetensors")}

    resumed = run(procs, 2, "--checkpoint-dir", URL, "--checkpoint-every", "10", "--resume", steps=30)
    assert resumed["resumed_from"] == 10 and "resuming from ckpt-000000010" in resumed["log"]  # ctx.resume_step
    same_end(resumed, thirty_steps_written[0])  # ends where an uninterrupted run ends
    assert listed(URL) == [("ckpt-000000010", "ok"), ("ckpt-000000020", "ok"), ("ckpt-000000030", "ok")]
    assert procs.leftovers() == []


@pytest.mark.timeout(120)
def test_the_unfinished_uploads_of_killed_writes_are_aborted_and_no_others(s3):
    s3()
    client = s3fs.S3FileSystem(skip_instance_cache=True)
    keys = ["run1/ckpt-000000020/shard-1.safetensors", "run1/ckpt-000000030/shard-0.safetensors",
            "run10/ckpt-000000020/shard-1.safetensors", "run1/notes/ckpt-000000020"]  # the last two: not ours
    for key in keys:  # what a writer killed between parts leaves: an upload begun, a part sent, never completed
        upload = client.call_s3("create_multipart_upload", Bucket=BUCKET, Key=key)
        client.call_s3("upload_part", Bucket=BUCKET, Key=key, PartNumber=1, UploadId=upload["UploadId"], Body=b"x")
    store = CheckpointStore(URL)
    assert sorted(store.remove_temporary("ckpt-000000030")) == [f"{BUCKET}/{keys[1]}"]
    assert sorted(store.remove_temporary()) == [f"{BUCKET}/{keys[0]}"]
    assert sorted(upload["Key"] for upload in client.list_multipart_uploads(BUCKET)) == sorted(keys[2:])
    assert store.complete() == []  # an unfinished upload never shows as an object


@pytest.mark.timeout(120)
def test_a_store_sees_checkpoints_other_processes_commit_after_it_listed(s3):
    s3()
    reader = CheckpointStore(URL)
    writer = CheckpointStore(URL, fs=s3fs.S3FileSystem(skip_instance_cache=True))  # as another process would
    for step in (10, 20):
        name = f"ckpt-{step:09d}"
        entry = writer.write_shard(name, 0, b"shard bytes %d" % step)
        writer.commit(name, {"step": step, "num_shards": 1, "shards": [dataclasses.asdict(entry)]})
        assert reader.complete()[-1] == name  # a cached listing (s3fs's default) would still say the one before
        assert reader.verify(name)["step"] == step


@pytest.mark.timeout(120)
def test_a_chain_in_s3_restores_what_a_whole_checkpoint_restores_and_retention_keeps_it(s3, tmp_path):
    from tests.unit.test_incremental_checkpoints import Cluster, assert_same, restored

    from paramserver.checkpoint.restore import RestoreSource
    from paramserver.checkpoint.store import checkpoint_name

    s3()
    cluster = Cluster(tmp_path, num_ps=2, chain_url=URL)
    for step in range(1, 5):
        cluster.train(3)
        cluster.checkpoint(step, delta=step > 1)
    name = checkpoint_name(4)
    reader = CheckpointStore(URL)  # another store: what it lists and reads comes from the server
    assert RestoreSource.latest(reader).links == [checkpoint_name(step) for step in range(1, 5)]
    assert_same(restored(reader, name, 3), restored(cluster.whole, name, 3))
    assert reader.prune(keep=1) == []  # 4 needs 1..3
    assert [row for row in listed(URL) if row[1] != "ok"] == []
