"""A real local Redis Cluster for tests and benchmarks: 3 masters + 3 replicas on loopback
ports.

``LocalCluster(directory).start()`` starts six ``redis-server --cluster-enabled yes``
processes (AOF on, ``appendfsync everysec``; ``appendonly=False``: no persistence), joins
them with ``redis-cli --cluster create ... --cluster-replicas 1`` and waits until every node
reports ``cluster_state:ok``.
``kill_master(slot)`` SIGKILLs the master that owns a slot and waits until its replica has
been promoted (the cluster's own failover, ``cluster-node-timeout`` 1 s here).
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from rollq.ops.local.process_groups import kill_group, stop_group


def cluster_port() -> int:
    """A free port P with P + 10000 free too (the cluster bus port), P <= 55535."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        if all(_free(p) for p in (port, port + 10000)):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class LocalNode:
    port: int
    directory: Path
    appendonly: bool = True
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", "1000",
             "--appendonly", "yes" if self.appendonly else "no",
             # a replica may always take over (the default refuses one whose link to the
             # master has been down for a while: after a long test pause, say)
             "--cluster-replica-validity-factor", "0",
             "--appendfsync", "everysec", "--save", "", "--dir", str(self.directory),
             "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if _ping(self.port):
                return
            time.sleep(0.02)
        raise RuntimeError(f"cluster node on port {self.port} did not start")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            kill_group(self.process)
        self.process = None

    def stop(self) -> None:
        if self.process is not None:
            stop_group(self.process, grace_s=10)
        self.process = None


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _cli(port: int, *args: str) -> str:
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True,
                          text=True, timeout=30, check=True).stdout


@dataclass
class LocalCluster:
    directory: Path
    masters: int = 3
    replicas_per_master: int = 1
    appendonly: bool = True
    nodes: list[LocalNode] = field(default_factory=list)

    @property
    def url(self) -> str:
        """A seed URL (any node); rollq's cluster scheme, see ``ops.settings``."""
        return f"redis+cluster://127.0.0.1:{self.live_ports()[0]}/0"

    def primaries(self) -> list[int]:
        """Ports of the masters now serving slots."""
        ports = []
        for line in _cli(self.live_ports()[0], "cluster", "nodes").splitlines():
            parts = line.split()
            if "master" in parts[2] and "fail" not in parts[2] and len(parts) > 8:
                ports.append(int(parts[1].split("@")[0].rsplit(":", 1)[1]))
        return sorted(ports)

    def live_ports(self) -> list[int]:
        return [n.port for n in self.nodes if n.process is not None]

    def start(self) -> LocalCluster:
        if shutil.which("redis-cli") is None:
            raise RuntimeError("redis-cli is not installed")
        count = self.masters * (1 + self.replicas_per_master)
        self.nodes = [LocalNode(cluster_port(), self.directory / f"node-{i}",
                                  appendonly=self.appendonly) for i in range(count)]
        for node in self.nodes:
            node.start()
        subprocess.run(
            ["redis-cli", "--cluster", "create",
             *(f"127.0.0.1:{n.port}" for n in self.nodes),
             "--cluster-replicas", str(self.replicas_per_master), "--cluster-yes"],
            capture_output=True, text=True, timeout=60, check=True)
        self.wait_ok()
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok`` and all slots are served."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                states = [_cli(port, "cluster", "info") for port in self.live_ports()]
            except subprocess.SubprocessError:
                states = []
            if states and all("cluster_state:ok" in s and "cluster_slots_ok:16384" in s
                              for s in states) and self._replicas_synced():
                return
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def _replicas_synced(self) -> bool:
        """Every replica has finished its initial sync (only then can it take over)."""
        try:
            infos = [_cli(port, "info", "replication") for port in self.live_ports()]
        except subprocess.SubprocessError:
            return False
        replicas = [i for i in infos if "role:slave" in i]
        return (len(replicas) >= self.masters * self.replicas_per_master - (
            len(self.nodes) - len(self.live_ports()))
            and all("master_link_status:up" in i for i in replicas))

    def master_of(self, slot: int) -> LocalNode:
        for line in _cli(self.live_ports()[0], "cluster", "nodes").splitlines():
            parts = line.split()
            if "master" not in parts[2] or "fail" in parts[2]:
                continue
            for ranges in parts[8:]:
                low, _, high = ranges.partition("-")
                if low.isdigit() and int(low) <= slot <= int(high or low):
                    port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
                    return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"no master serves slot {slot}")

    def kill_master(self, slot: int) -> LocalNode:
        """SIGKILL the master of ``slot``; returns it once its replica took over."""
        victim = self.master_of(slot)
        victim.kill()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if self.master_of(slot).port != victim.port:
                    self.wait_ok()
                    return victim
            except (LookupError, subprocess.SubprocessError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"no replica took over slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
