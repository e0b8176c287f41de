"""A real S3-compatible server for tests: moto's server app in a process of its own, on 127.0.0.1
port 0, and the environment that points botocore (so s3fs, in every process) at it.

``python -m tests.integration.s3_server [--hold SUFFIX]`` prints ``S3_READY <endpoint>`` once it
listens. With ``--hold``, the first PUT whose path ends with SUFFIX is never answered: the server
prints ``HELD <path>`` and keeps the request open without storing anything, so a test can kill
the writer while its write is in flight (moto's own ``moto_server`` has no such hook; this is its
app behind the same werkzeug server).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading

from tests.conftest import ROOT

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def holding(app, suffix: str | None):
    """`app`, except that the first PUT of a path ending with `suffix` hangs unanswered."""
    held = threading.Lock()

    def serve(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if suffix and environ["REQUEST_METHOD"] == "PUT" and path.endswith(suffix) and held.acquire(blocking=False):
            print(f"HELD {path}", flush=True)
            threading.Event().wait()  # never answered: the writer dies waiting; the object never exists
        return app(environ, start_response)

    return serve


def main() -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    parser = argparse.ArgumentParser()
    parser.add_argument("--hold", help="hold the first PUT whose path ends with this")
    args = parser.parse_args()
    app = holding(DomainDispatcherApplication(create_backend_app), args.hold)
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
    print(f"S3_READY http://127.0.0.1:{server.server_port}", flush=True)
    server.serve_forever()


class S3Server:
    """The server process, its output lines (read by a thread), and its endpoint."""

    def __init__(self, hold: str | None = None, timeout: float = 120) -> None:
        argv = [sys.executable, "-m", "tests.integration.s3_server", *(["--hold", hold] if hold else [])]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, name="s3-server-output", daemon=True).start()
        try:
            self.endpoint = self.wait_for("S3_READY", timeout).split()[-1]
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.strip())
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()  # the server is gone: a waiter must not wait out its timeout

    def wait_for(self, prefix: str, timeout: float = 240) -> str:
        """The first output line starting with `prefix` (the timeout only guards a hang)."""
        def found():
            return next((line for line in self.lines if line.startswith(prefix)), None)

        with self._changed:
            if not self._changed.wait_for(lambda: found() or self.proc.poll() is not None, timeout) or not found():
                raise AssertionError(f"the S3 server said no {prefix!r} (exit {self.proc.poll()}): {self.lines}")
            return found()

    def env(self) -> dict[str, str]:
        """What every process needs to reach it: botocore reads the endpoint and keys from the environment."""
        return {"AWS_ENDPOINT_URL": self.endpoint, **CREDENTIALS}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # a held request never ends: no graceful stop to wait for
        self.proc.wait(30)


if __name__ == "__main__":
    main()
