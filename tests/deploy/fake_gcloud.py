"""A stand-in for `gcloud` that deploy/tpu_vm.sh's tests put first on PATH.

Each call appends {"argv": [...]} to $FAKE_GCLOUD_DIR/log.jsonl (scp calls also carry the text of
the files they copy, or a tarball's member names) and answers like the real one for what the
script uses: TPU VMs live in $FAKE_GCLOUD_DIR/vms.json, so describe says NOT_FOUND (exit 1) until
create, ssh runs nothing but answers `id -un` and the health checks (the server's, the
router's), delete removes the VM. Each VM's workers have IPs of their own (worker_ip).

Knobs (environment): FAKE_GCLOUD_PROJECT (the gcloud config project; unset = none),
FAKE_HEALTH_FAILURES (health checks that fail before one says SERVING; "never"),
FAKE_GCLOUD_FAIL (a verb, e.g. create, that fails with PERMISSION_DENIED).
"""

import json
import os
import re
import sys
import tarfile
from pathlib import Path

STATE = Path(os.environ["FAKE_GCLOUD_DIR"])
VMS = STATE / "vms.json"
LOGIN_USER = "tpuuser"
SECRET_TOKEN = "s3cret-from-secret-manager"


def worker_ip(i: int, vm: int = 0) -> str:
    """Worker i's internal IP on the vm-th TPU VM created."""
    return f"10.130.{vm}.{2 + i}"


def fail(message: str, code: int = 1):
    print(f"ERROR: (gcloud) {message}", file=sys.stderr)
    sys.exit(code)


def flags(argv: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) if "=" in a else (a[2:], "") for a in argv if a.startswith("--"))


def load_vms() -> dict:
    return json.loads(VMS.read_text()) if VMS.exists() else {}


def copied_files(words: list[str]) -> dict:
    out = {}
    for word in words:
        path = Path(word)
        if ":" in word or not path.is_file():
            continue
        if word.endswith(".tar.gz"):
            with tarfile.open(path) as tar:
                out[word] = sorted(tar.getnames())
        elif path.stat().st_size < 65536:
            out[word] = path.read_text(errors="replace")
    return out


def describe(name: str, opts: dict) -> None:
    vm = load_vms().get(name)
    if vm is None:
        fail(
            f"NOT_FOUND: Resource 'projects/{opts.get('project')}/locations/{opts.get('zone')}/nodes/{name}' "
            "was not found"
        )
    ip = worker_ip(0, list(load_vms()).index(name))
    fields = {"state": vm["state"], "acceleratorType": vm["type"], "networkEndpoints[0].ipAddress": ip}
    match = re.fullmatch(r"value\((.*)\)", opts.get("format", ""))
    if match:
        print("\t".join(fields[f] for f in match.group(1).split(",")))
    else:
        print(f"name: {name}\nstate: {vm['state']}\nacceleratorType: {vm['type']}")


def ssh(name: str, opts: dict) -> None:
    if name not in load_vms():
        fail(f"NOT_FOUND: {name}")
    command = opts.get("command", "")
    if command == "id -un":
        print(LOGIN_USER)
    elif "ROUTER-OK" in command:  # vllm-router's /health probed on worker 0
        print("ROUTER-OK")
    elif command.endswith(" health"):
        counter = STATE / "health_checks"
        checks = int(counter.read_text()) + 1 if counter.exists() else 1
        counter.write_text(str(checks))
        failures = os.environ.get("FAKE_HEALTH_FAILURES", "0")
        if failures == "never" or checks <= int(failures):
            print("error: UNAVAILABLE: failed to connect to all addresses", file=sys.stderr)
            sys.exit(1)
        print("SERVING")


def tpu_vm(verb: str, name: str, opts: dict, argv: list[str]) -> None:
    vms = load_vms()
    if verb == "describe":
        describe(name, opts)
    elif verb == "create":
        if name in vms:
            fail(f"ALREADY_EXISTS: {name}")
        vms[name] = {"type": opts["accelerator-type"], "state": "READY", "version": opts["version"]}
        VMS.write_text(json.dumps(vms))
    elif verb == "delete":
        if vms.pop(name, None) is None:
            fail(f"NOT_FOUND: {name}")
        VMS.write_text(json.dumps(vms))
    elif verb == "ssh":
        ssh(name, opts)
    elif verb == "scp":
        if name.split(":")[0] not in vms:
            fail(f"NOT_FOUND: {name}")


def main(argv: list[str]) -> None:
    words = [a for a in argv if not a.startswith("--")]
    record = {"argv": argv}
    if words[:4] == ["compute", "tpus", "tpu-vm", "scp"]:
        record["files"] = copied_files(words[4:])
    with open(STATE / "log.jsonl", "a") as log:
        log.write(json.dumps(record) + "\n")
    opts = flags(argv)
    if os.environ.get("FAKE_GCLOUD_FAIL") in words:
        fail("PERMISSION_DENIED: the caller does not have permission")
    if words[:3] == ["config", "get-value", "project"]:
        print(os.environ.get("FAKE_GCLOUD_PROJECT", ""))
    elif words[:2] == ["storage", "du"]:  # the model's bytes: FAKE_GCLOUD_DU_BYTES, else small
        print(f"{os.environ.get('FAKE_GCLOUD_DU_BYTES', '1000000')}  {words[-1]}")
    elif words[:3] == ["secrets", "versions", "access"]:
        print(SECRET_TOKEN, end="")
    elif words[:3] == ["compute", "tpus", "tpu-vm"] and len(words) >= 5:
        target = words[-1] if words[3] == "scp" else words[4]  # scp: SRC... NAME:DEST
        tpu_vm(words[3], target, opts, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
