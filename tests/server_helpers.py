"""Starting a real rlt-hal server process on a free loopback port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model_dir, *extra: str, env: dict[str, str] | None = None) -> None:
        """``model_dir`` None: the default model (the embedded random toy checkpoint)."""
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        given = env or {}
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **given}
        if "RLT_HAL_NPU_EMULATE" not in given:  # the emulated npu only where a test asks
            env.pop("RLT_HAL_NPU_EMULATE", None)
        cmd = [
            sys.executable,
            "-m",
            "runtime_glue.cli.main",
            "serve",
            *(() if model_dir is None else ("--model", str(model_dir))),
            "--port",
            str(self.port),
            "--served-model-name",
            "toy",
            "--block-size",
            "16",
            "--num-blocks",
            "64",
            *extra,
        ]
        # A file, not a pipe: a server that logs more than a pipe holds must never block on it.
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives as the server does
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.output()}")
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("server did not become healthy within 120 s")

    def output(self) -> str:
        """Everything the server wrote to stdout and stderr so far."""
        self.log.seek(0)
        return self.log.read()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.base + "/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self, sig=None) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig) if sig else self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
