"""deploy/tpu_vm.sh's settings (flag > environment > config file > default), its usage errors
(exit 2, the bad value named, no gcloud run), its --help table, and shellcheck over deploy/."""

import shutil
import subprocess

import pytest
from deploy_support import ROOT, SCRIPT, VM


def create_flags(out) -> dict[str, str]:
    """--key=value flags of the `gcloud ... create` line that a dry run prints."""
    line = next(line for line in out.stdout.splitlines() if " tpu-vm create " in line)
    return dict(w[2:].split("=", 1) for w in line.split() if w.startswith("--") and "=" in w)


def test_flag_beats_env_beats_config_file_beats_default(deploy, tmp_path):
    config = tmp_path / "tpu.conf"
    config.write_text(
        "# a comment\n\nJAXINFER_TPU_NAME=from-config\nJAXINFER_TPU_ZONE=zone-config\n"
        "JAXINFER_TPU_PROJECT='proj-config'\nJAXINFER_TPU_ACCELERATOR_TYPE=\"v4-8\"\n"
    )
    base = ["create", "--dry-run", "--config", config]
    out = deploy(*base)
    assert out.returncode == 0, out.stderr
    assert create_flags(out) | {"name": out.stdout.split(" create ")[1].split()[0]} == {
        "zone": "zone-config",
        "project": "proj-config",
        "accelerator-type": "v4-8",
        "version": "tpu-ubuntu2204-base",
        "scopes": "https://www.googleapis.com/auth/cloud-platform",
        "name": "from-config",
    }
    env = {"JAXINFER_TPU_ZONE": "zone-env", "JAXINFER_TPU_ACCELERATOR_TYPE": "v6e-16"}
    out = deploy(*base, env=env)
    assert create_flags(out)["zone"] == "zone-env" and create_flags(out)["accelerator-type"] == "v6e-16"
    assert create_flags(out)["project"] == "proj-config"
    out = deploy(*base, "--zone", "zone-flag", "--version=v-flag", env=env)
    assert create_flags(out)["zone"] == "zone-flag" and create_flags(out)["version"] == "v-flag"
    out = deploy(*base, env={"JAXINFER_TPU_CONFIG": str(config), "JAXINFER_TPU_ZONE": ""})  # empty = unset
    assert create_flags(out)["zone"] == "zone-config"
    out = deploy("create", "--dry-run", env={"JAXINFER_TPU_CONFIG": str(config)})
    assert create_flags(out)["accelerator-type"] == "v4-8"
    assert deploy.argvs() == []


def test_default_accelerator_and_project_from_gcloud_config(deploy):
    out = deploy("create", "--name", "n", "--zone", "z", env={"FAKE_GCLOUD_PROJECT": "proj-gcloud"})
    assert out.returncode == 0, out.stderr
    assert deploy.argvs()[0] == ["config", "get-value", "project"]
    assert "--project=proj-gcloud" in deploy.argvs()[-1] and "--accelerator-type=v6e-8" in deploy.argvs()[-1]


def test_missing_project_is_a_usage_error(deploy):
    out = deploy("create", "--name", "n", "--zone", "z")
    assert out.returncode == 2 and "missing project: pass --project" in out.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["create", "--name", "n", "--project", "p"], "missing zone: pass --zone, set JAXINFER_TPU_ZONE"),
        (["serve", "--zone", "z", "--project", "p"], "missing name: pass --name"),
        (["deploy", *VM], "unknown command 'deploy'"),
        (["create", *VM, "--zones", "z"], "unknown flag '--zones'"),
        (["create", *VM, "stray"], "unexpected argument 'stray'"),
        (["create", *VM, "--zone"], "flag --zone needs a value"),
        (["serve", *VM, "--port", "70000"], "port '70000' (from flag --port): must be an integer in [1, 65535]"),
        (["serve", *VM, "--wait-timeout", "soon"], "wait timeout 'soon' (from flag --wait-timeout)"),
        (["create", *VM, "--provisioning", "cheap"], "provisioning 'cheap' (from flag --provisioning)"),
        (["serve", *VM, "--mesh", "tensor:4"], "mesh 'tensor:4' (from flag --mesh)"),
        (["serve", *VM, "--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
        (["serve", *VM, "--auth-token-file", "t", "--auth-secret", "s"], "mutually exclusive"),
        (
            ["serve", *VM, "--auth-token-file", "no-such-token"],
            "auth token file 'no-such-token' (from flag --auth-token-file): no such file",
        ),
        (["install", *VM, "--model", "gs://b/we ird"], "its last path part must be a plain name"),
        (
            ["serve-command", "--accelerator-type", "v6e-16", "--coordinator", "h", "--worker", "4"],
            "--worker 4: the slice has workers 0..3",
        ),
        (["create", "--config", "no-such.conf"], "config file 'no-such.conf' does not exist"),
        (["serve", *VM, "--remote-dir", "relative/dir"], "remote dir 'relative/dir' (from flag --remote-dir)"),
    ],
)
def test_usage_errors_exit_2_and_run_no_gcloud(deploy, args, message):
    out = deploy(*args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr
    assert out.stderr.startswith("tpu_vm.sh: error: ")
    assert deploy.argvs() == []


@pytest.mark.parametrize(
    "line,message",
    [
        ("JAXINFER_TPU_ZONES=z", "tpu.conf:2: unknown key JAXINFER_TPU_ZONES"),
        ("ZONE=z", "tpu.conf:2: expected JAXINFER_TPU_KEY=VALUE, got 'ZONE=z'"),
        ("export JAXINFER_TPU_ZONE=z", "expected JAXINFER_TPU_KEY=VALUE"),
    ],
)
def test_config_file_errors_name_the_line(deploy, tmp_path, line, message):
    (tmp_path / "tpu.conf").write_text(f"JAXINFER_TPU_NAME=n\n{line}\n")
    out = deploy("create", *VM, "--config", tmp_path / "tpu.conf")
    assert out.returncode == 2 and message in out.stderr


def test_config_values_are_not_evaluated(deploy, tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / "tpu.conf").write_text(f"JAXINFER_TPU_ZONE=$(touch {marker})\n")
    out = deploy("create", "--name", "n", "--project", "p", "--dry-run", "--config", tmp_path / "tpu.conf")
    assert out.returncode == 0, out.stderr
    assert f"'--zone=$(touch {marker})'" in out.stdout and not marker.exists()


def test_help_has_one_table_of_every_setting(deploy):
    out = deploy("--help")
    assert out.returncode == 0
    text = out.stdout
    assert "flag > environment > config file > default" in text
    rows = [
        line.split()
        for line in text.splitlines()
        if line.strip().startswith("--") and len(line.split()) > 2 and line.split()[1].startswith("JAXINFER_TPU_")
    ]
    settings = {r[0]: r[1] for r in rows}
    for flag in (
        "--name",
        "--zone",
        "--project",
        "--accelerator-type",
        "--version",
        "--model",
        "--port",
        "--mesh",
        "--auth-token-file",
        "--auth-secret",
        "--tls-cert",
        "--tls-key",
        "--wait-timeout",
        "--grace-period",
        "--remote-dir",
    ):
        assert settings[flag] == "JAXINFER_TPU_" + flag[2:].upper().replace("-", "_")
    assert deploy("create", "--help").stdout == text


def test_shellcheck_passes_on_every_file_under_deploy():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (Debian/Ubuntu: apt-get install -y shellcheck)")
    files = sorted(p for p in (ROOT / "deploy").rglob("*") if p.is_file() and p.suffix in ("", ".sh"))
    assert SCRIPT in files and len(files) >= 2
    out = subprocess.run(
        [shellcheck, "--external-sources", "--severity=style", *map(str, files)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
