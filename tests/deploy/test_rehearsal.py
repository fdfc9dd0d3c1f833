"""A local rehearsal of a two-host slice: the `jaxinfer serve` command lines that
`deploy/tpu_vm.sh serve-command --worker I` prints for workers 0 and 1 of a v5p-16 run as two
processes on loopback (jax.distributed over 127.0.0.1, one CPU device each, mesh tensor=2).

Local paths stand in for the workers' in one documented way: --remote-dir points at a tmp dir
whose venv/ links to this checkout's .venv, models/llama3 to the tiny Llama fixture and
secrets/token holds the token, so the printed commands run unchanged. A client gets process 0's
greedy tokens (they equal HF's, so both processes computed them); SIGTERM ends both with exit 0.
"""

import json
import shlex
import signal
import socket
import subprocess
import threading

import pytest
from deploy_support import ROOT
from testpaths import FIXTURES
from xla_env import child_env

LLAMA = FIXTURES / "hf" / "llama3"
TINY = [
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--max-num-seqs",
    "8",
    "--max-num-batched-tokens",
    "32",
    "--token-buckets",
    "8,32",
    "--num-pages",
    "48",
    "--no-penalties",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(stream, timeout: float) -> str:
    """The server's "listening on" line (on CPU, Gloo prints its own lines to stdout first)."""
    box = []

    def read():
        for line in stream:
            if line.startswith("listening on"):
                box.append(line)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else ""


@pytest.fixture
def remote_dir(tmp_path):
    """Stands in for /opt/jaxinfer on the workers."""
    remote = tmp_path / "remote"
    (remote / "models").mkdir(parents=True)
    (remote / "venv").symlink_to(ROOT / ".venv")
    (remote / "models" / "llama3").symlink_to(LLAMA)
    (remote / "secrets").mkdir(mode=0o700)
    (remote / "secrets" / "token").write_text("rehearsal-token\n")
    return remote


def test_two_workers_serve_on_loopback_with_the_generated_flags(deploy, remote_dir, tmp_path):
    port, coordinator_port = free_port(), free_port()
    (tmp_path / "token").write_text("rehearsal-token\n")
    settings = [
        "--accelerator-type",
        "v5p-16",
        "--coordinator",
        "127.0.0.1",
        "--coordinator-port",
        coordinator_port,
        "--host",
        "127.0.0.1",
        "--port",
        port,
        "--mesh",
        "tensor=2",
        "--model",
        LLAMA,
        "--remote-dir",
        remote_dir,
        "--auth-token-file",
        tmp_path / "token",
        "--grace-period",
        "20",
    ]
    commands = []
    for worker in (0, 1):
        out = deploy("serve-command", "--worker", worker, *settings, "--", *TINY)
        assert out.returncode == 0, out.stderr
        commands.append(shlex.split(out.stdout))
        assert commands[-1][:2] == [f"{remote_dir}/venv/bin/jaxinfer", "serve"]
        flags = commands[-1][commands[-1].index("--coordinator-address") :][:6]
        assert flags == [
            "--coordinator-address",
            f"127.0.0.1:{coordinator_port}",
            "--num-processes",
            "2",
            "--process-id",
            str(worker),
        ]
    assert deploy.argvs() == []  # no gcloud: the accelerator type and the coordinator were given

    env = child_env(drop=("JAXINFER_AUTH_TOKEN",), JAX_PLATFORMS="cpu", HOME=str(tmp_path))
    logs = [open(tmp_path / f"worker{i}.log", "w") for i in (0, 1)]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=tmp_path)
        for cmd, log in zip(commands, logs)
    ]
    try:
        line = wait_listening(procs[0].stdout, 240)
        tail = lambda: "".join((tmp_path / f"worker{i}.log").read_text()[-2000:] for i in (0, 1))
        assert line.startswith(f"listening on 127.0.0.1:{port}"), line + tail()
        client = [f"{remote_dir}/venv/bin/jaxinfer", "client", "--server", f"127.0.0.1:{port}"]
        health = subprocess.run(
            [*client, "--timeout", "10", "health"], capture_output=True, text=True, env=env, timeout=60
        )
        assert health.stdout.strip() == "SERVING", health.stderr
        golden = json.loads((LLAMA / "generate.json").read_text())
        prompt, expected = golden["prompts"][1], golden["outputs"][1][:12]
        out = subprocess.run(
            [*client, "generate", "--token-ids", ",".join(map(str, prompt)), "--max-tokens", "12", "--ignore-eos"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**env, "JAXINFER_AUTH_TOKEN": "rehearsal-token"},
        )
        assert out.returncode == 0, out.stderr + tail()
        assert [int(t) for t in out.stdout.split()] == expected
        denied = subprocess.run([*client, "info"], capture_output=True, text=True, env=env, timeout=60)
        assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
        for proc in procs:  # what `tpu_vm.sh stop` does: worker 0 first, then every worker
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(timeout=120) for proc in procs]
        assert codes == [0, 0], tail()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for log in logs:
            log.close()
