"""Helpers of the deploy tests: run deploy/tpu_vm.sh against fake_gcloud.py and read its log."""

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "tpu_vm.sh"
FAKE = Path(__file__).resolve().parent / "fake_gcloud.py"
VM = ["--name", "tpu1", "--zone", "us-east5-b", "--project", "proj1"]


@dataclass
class Deploy:
    state: Path
    env: dict

    def __call__(self, *args, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(SCRIPT), *map(str, args)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**self.env, **(env or {})},
            cwd=self.state,
        )

    def calls(self) -> list[dict]:
        log = self.state / "log.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def argvs(self) -> list[list[str]]:
        return [c["argv"] for c in self.calls()]

    def clear(self) -> None:
        (self.state / "log.jsonl").unlink(missing_ok=True)

    def add_vm(self, name: str, accelerator_type: str, state: str = "READY") -> None:
        vms = self.state / "vms.json"
        known = json.loads(vms.read_text()) if vms.exists() else {}
        known[name] = {"type": accelerator_type, "state": state, "version": "v"}
        vms.write_text(json.dumps(known))


def install_fake_gcloud(tmp_path: Path) -> Deploy:
    """A `gcloud` in tmp_path/bin that runs fake_gcloud.py, state in tmp_path/state."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(FAKE))} "$@"\n')
    gcloud.chmod(0o755)
    state = tmp_path / "state"
    state.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXINFER_TPU_", "FAKE_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_GCLOUD_DIR=str(state))
    return Deploy(state, env)


def ssh_commands(argvs, worker: str | None = None) -> list[str]:
    """The --command= of every ssh call (to `worker` only, when given)."""
    out = []
    for argv in argvs:
        if argv[:4] == ["compute", "tpus", "tpu-vm", "ssh"] and (worker is None or f"--worker={worker}" in argv):
            out += [a.split("=", 1)[1] for a in argv if a.startswith("--command=")]
    return out


def verb(argv: list[str]) -> str:
    return argv[3] if argv[:3] == ["compute", "tpus", "tpu-vm"] else " ".join(argv[:3])


def units(calls: list[dict]) -> dict[int, str]:
    """Worker index -> the text of the systemd unit scp'd to it."""
    out = {}
    for call in calls:
        argv = call["argv"]
        if verb(argv) == "scp" and any(a.endswith("/jaxinfer.service") for a in argv):
            worker = int(next(a for a in argv if a.startswith("--worker=")).split("=")[1])
            out[worker] = next(iter(call["files"].values()))
    return out


def exec_start(unit: str) -> list[str]:
    line = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart="))
