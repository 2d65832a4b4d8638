"""A real redis-server that speaks only TLS, with a CA made for the test and ACL users.

``TlsRedis(directory).start()`` writes a self-signed CA, a server certificate for
127.0.0.1/localhost and a client certificate (``openssl``), then starts ``redis-server
--port 0 --tls-port P`` (plain TCP off) requiring client certificates only when
``client_certs`` is set. ``acl(...)`` adds ACL users; ``url(user, password)`` is the
``rediss://`` URL to reach it, and ``ca``/``cert``/``key`` are the files a client needs.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from rollq.ops.local.process_groups import stop_group
from rollq.ops.local.stack import free_port

ADMIN_PASSWORD = "admin-secret-pw"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(directory: Path) -> None:
    """ca.crt/ca.key, server.crt/server.key (SAN 127.0.0.1, localhost), client.crt/.key."""
    directory.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             "/CN=rollq test CA", "-keyout", "ca.key", "-out", "ca.crt", cwd=directory)
    (directory / "san.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=rollq test {name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=directory)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-extfile", "san.cnf", "-out", f"{name}.crt",
                 cwd=directory)


@dataclass
class TlsRedis:
    directory: Path
    client_certs: bool = False
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def ca(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def cert(self) -> Path:
        return self.directory / "client.crt"

    @property
    def key(self) -> Path:
        return self.directory / "client.key"

    def url(self, user: str = "admin", password: str = ADMIN_PASSWORD, db: int = 0) -> str:
        return f"rediss://{user}:{password}@127.0.0.1:{self.port}/{db}"

    def start(self) -> TlsRedis:
        make_certificates(self.directory)
        self.port = free_port()
        self.process = subprocess.Popen(
            ["redis-server", "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1",
             "--tls-cert-file", str(self.directory / "server.crt"),
             "--tls-key-file", str(self.directory / "server.key"),
             "--tls-ca-cert-file", str(self.ca),
             "--tls-auth-clients", "yes" if self.client_certs else "no",
             "--save", "", "--appendonly", "no", "--dir", str(self.directory),
             "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                admin = self._client("default", None)
                admin.acl_setuser("admin", enabled=True, passwords=[f"+{ADMIN_PASSWORD}"],
                                  keys=["*"], channels=["*"], commands=["+@all"])
                admin.acl_setuser("default", enabled=False)  # nothing without a password
                admin.close()
                return self
            except (redis.ConnectionError, OSError):
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("the TLS redis-server did not start")

    def _client(self, user: str, password: str | None) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, username=user, password=password,
                           ssl=True, ssl_ca_certs=str(self.ca),
                           ssl_certfile=str(self.cert) if self.client_certs else None,
                           ssl_keyfile=str(self.key) if self.client_certs else None)

    def admin(self) -> redis.Redis:
        return self._client("admin", ADMIN_PASSWORD)

    def acl(self, user: str, password: str, *rules: str) -> None:
        """``ACL SETUSER user reset on >password <rules…>``."""
        with self.admin() as client:
            client.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}",
                                   *rules)

    def stop(self) -> None:
        if self.process is not None:
            stop_group(self.process, grace_s=10)
        self.process = None
