"""
A local S3-compatible server for the tests: moto in server mode on 127.0.0.1.

``moto[server]`` comes with the ``test`` extra, so ``pip install -e ".[test]"`` is all a CI
machine needs. The server runs in a child process on a free port and is stopped when the
test session ends; :func:`s3_env` gives the environment that points clients at it the
standard way (``AWS_ENDPOINT_URL`` and the credential variables).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BUCKET = "resumable-tests"
STARTUP_TIMEOUT = 30.0


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """A running moto server and the environment pointing at it."""

    def __init__(self, endpoint: str, bucket: str, config_dir: Path) -> None:
        self.endpoint = endpoint
        self.bucket = bucket
        self.config_dir = config_dir

    def env(self) -> dict[str, str]:
        """Variables a client (here or in a child process) needs to reach the server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            # nothing from the developer's own ~/.aws may leak in
            "AWS_CONFIG_FILE": str(self.config_dir / "config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(self.config_dir / "credentials"),
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }

    def url(self, name: str = "") -> str:
        """A fresh ``s3://`` URL in the test bucket (unique unless *name* is given)."""
        return f"s3://{self.bucket}/{name or uuid.uuid4().hex}"

    def storage_options(self) -> dict[str, object]:
        """The same settings as ``storage_options`` for fsspec, without any environment."""
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
        }


def _wait_until_up(endpoint: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            msg = f"moto server exited with status {proc.returncode} before listening"
            raise RuntimeError(msg)
        try:
            with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1):  # noqa: S310 - our own local server
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.05)
    msg = f"moto server did not answer on {endpoint} within {STARTUP_TIMEOUT:.0f} s"
    raise RuntimeError(msg)


def _create_bucket(server: S3Server) -> None:
    import boto3  # comes with moto

    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=server.bucket)


@contextmanager
def running_server(config_dir: Path, bucket: str = BUCKET) -> Iterator[S3Server]:
    """Start moto on a free port, create *bucket*, yield the server; stop it afterwards."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        _wait_until_up(endpoint, proc)
        server = S3Server(endpoint, bucket, config_dir)
        _create_bucket(server)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
