"""`paramserver shutdown`: the admin's Shutdown call drains a real PS process, which exits 0; a worker's
is refused PERMISSION_DENIED, audited, and changes nothing."""

import json

import numpy as np
import pytest

from paramserver.launch import cli
from paramserver.security.tokens import write_tokens
from paramserver.transport.grpc_transport import GrpcChannel
from paramserver.wire import codec

pytestmark = pytest.mark.cluster  # a real PS process

NODES = ["ps-0", "worker-0", "admin"]


def call(channel, method, meta, tensors=()):
    return codec.decode(channel.call(method, codec.encode(meta, tensors), 10).wait(10))


def test_only_an_admin_shuts_a_ps_down_and_it_drains_to_exit_0(procs, tmp_path, capsys):
    tokens, audit = tmp_path / "tokens", tmp_path / "audit.jsonl"
    write_tokens(tokens, NODES)
    options = {"auth_tokens": str(tokens / "tokens.json"), "audit_log": str(audit)}
    proc, address = procs.start_ps(PARAMSERVER_OPTIONS=json.dumps(options))
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"ps": [address], "worker": ["127.0.0.1:1"]}))
    worker = GrpcChannel(address, 1 << 24, use_stream=False, token=(tokens / "worker-0.token").read_text().strip())
    try:
        worker.wait_ready(20)
        initial = {"w": np.arange(6, dtype=np.float32)}
        call(worker, "Register", {"group": "g", "optimizer": {"name": "sgd", "hyper": {"lr": 1}}, "worker": 0},
             initial.items())
        before = call(worker, "PushPull", {"pull": ["w"], "worker": 0})

        code = cli.main(["shutdown", str(cluster), "--token-file", str(tokens / "worker-0.token"), "--reason", "x"])
        refused = json.loads(capsys.readouterr().out)
        assert code == 1 and not refused["draining"] and refused["error"].startswith("PERMISSION_DENIED")
        after = call(worker, "PushPull", {"pull": ["w"], "worker": 0})
        assert proc.poll() is None and after.meta["version"] == before.meta["version"]
        assert np.array_equal(after.tensors["w"], before.tensors["w"])
    finally:
        worker.close()

    code = cli.main(["shutdown", str(cluster), "--token-file", str(tokens / "admin.token"), "--reason", "end of job"])
    accepted = json.loads(capsys.readouterr().out)
    assert code == 0 and accepted["draining"] and accepted["version"] == 0
    assert proc.wait(60) == 0  # drained and exited by itself: no signal was sent
    records = [(r["what"], r["who"], r["outcome"]) for r in map(json.loads, audit.read_text().splitlines())
               if r["what"] == "Shutdown"]
    assert records == [("Shutdown", "worker-0", "PERMISSION_DENIED"), ("Shutdown", "admin", "ok")]
