"""deploy/tpu_vm.sh serve-cluster / router against fake_gcloud.py: N replicas or a prefill/decode
pair on separate TPU VMs, each serving its OpenAI HTTP API (a pair's servers with --kv-role and
their own worker 0's IP as --kv-transfer-host), vllm-router installed and run as a unit on worker 0
of the first VM in front of them (its command line, its health wait), and the usage errors."""

import shlex

import pytest
from deploy_support import exec_start, ssh_commands, verb

ZONE = ["--zone", "us-east5-b", "--project", "proj1", "--poll-interval", "0"]


def _units(calls: list[dict]) -> dict[tuple[str, str], str]:
    """(TPU VM, unit file name) -> the unit's text, of every unit scp'd to a worker 0."""
    out = {}
    for call in calls:
        argv = call["argv"]
        if verb(argv) == "scp" and "--worker=0" in argv:
            target = next(a for a in argv if ":" in a and a.endswith(".service"))
            name, path = target.split(":", 1)
            out[(name, path.rsplit("/", 1)[1])] = next(iter(call["files"].values()))
    return out


def _flag(argv: list[str], flag: str) -> list[str]:
    """The words after `flag` up to the next flag."""
    i = argv.index(flag) + 1
    end = next((j for j in range(i, len(argv)) if argv[j].startswith("--")), len(argv))
    return argv[i:end]


def test_replicas_serve_then_the_router_balances_them(deploy):
    for name in ("r-a", "r-b", "r-c"):
        deploy.add_vm(name, "v6e-8")
    out = deploy("serve-cluster", "--replicas", "r-a,r-b,r-c", *ZONE)
    assert out.returncode == 0, out.stderr
    units = _units(deploy.calls())
    ips = {"r-a": "10.130.0.2", "r-b": "10.130.1.2", "r-c": "10.130.2.2"}
    for name in ips:
        serve = exec_start(units[(name, "jaxinfer.service")])
        assert _flag(serve, "--http-port") == ["8000"] and _flag(serve, "--http-host") == ["0.0.0.0"]
        assert "--kv-role" not in serve
    router = exec_start(units[("r-a", "jaxinfer-router.service")])  # on worker 0 of the first
    assert router[:3] == ["/opt/jaxinfer/router/bin/python", "-m", "vllm_router.launch_router"]
    assert _flag(router, "--worker-urls") == [f"http://{ip}:8000" for ip in ips.values()]
    assert _flag(router, "--policy") == ["power_of_two"] and _flag(router, "--port") == ["8080"]
    # each server up (its health) before the router, the router installed, started, then waited for
    order = [(a[4], c) for a in deploy.argvs() if verb(a) == "ssh" for c in ssh_commands([a])]
    healths = [i for i, (_, c) in enumerate(order) if c.endswith(" health")]
    install = next(i for i, (_, c) in enumerate(order) if "vllm-router==0.1.17" in c)
    assert [order[i][0] for i in healths] == ["r-a", "r-b", "r-c"] and install > healths[-1]
    assert order[install][0] == "r-a" and "ROUTER-OK" in order[-1][1]
    assert "vllm-router on 10.130.0.2:8080 (worker 0 of r-a) in front of r-a r-b r-c" in out.stderr


def test_a_prefill_decode_pair_behind_the_routers_pd_mode(deploy):
    deploy.add_vm("pre", "v6e-8")
    deploy.add_vm("dec", "v5litepod-4")
    out = deploy("serve-cluster", "--prefill", "pre", "--decode", "dec", "--router-port", "9000", *ZONE)
    assert out.returncode == 0, out.stderr
    units = _units(deploy.calls())
    for name, role, ip, mesh in (
        ("pre", "prefill", "10.130.0.2", "tensor=8"),
        ("dec", "decode", "10.130.1.2", "tensor=4"),
    ):
        serve = exec_start(units[(name, "jaxinfer.service")])
        assert _flag(serve, "--kv-role") == [role] and _flag(serve, "--kv-transfer-host") == [ip]
        assert _flag(serve, "--mesh") == [mesh]  # each VM's own slice
    router = exec_start(units[("pre", "jaxinfer-router.service")])
    assert "--vllm-pd-disaggregation" in router and "--worker-urls" not in router
    assert _flag(router, "--prefill") == ["http://10.130.0.2:8000"] and _flag(router, "--decode") == [
        "http://10.130.1.2:8000"
    ]
    assert _flag(router, "--port") == ["9000"]


def test_the_router_alone_and_serve_command_of_a_role(deploy):
    deploy.add_vm("pre", "v6e-8")
    deploy.add_vm("dec", "v6e-8")
    assert deploy("router", "--prefill", "pre", "--decode", "dec", "--http-port", "8100", *ZONE).returncode == 0
    assert {a[4] for a in deploy.argvs() if verb(a) == "ssh"} == {"pre"}  # only the router's VM is touched
    router = exec_start(_units(deploy.calls())[("pre", "jaxinfer-router.service")])
    assert _flag(router, "--decode") == ["http://10.130.1.2:8100"]
    out = deploy("serve-command", "--name", "dec", "--kv-role", "decode", *ZONE[:4])
    assert out.returncode == 0, out.stderr
    assert _flag(shlex.split(out.stdout), "--kv-transfer-host") == ["10.130.1.2"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replicas", "a,b", "--prefill", "c", "--decode", "d"], "two topologies: give one"),
        (["--prefill", "c"], "--prefill and --decode go together"),
        (["--prefill", "c", "--decode", "c"], "must be two TPU VMs"),
        ([], "missing the servers"),
        (["--replicas", "a,B_2"], "'B_2': not a TPU VM name"),
        (["--replicas", "a,b", "--router-policy", "kv_aware"], "expected random, round_robin"),
    ],
)
def test_cluster_usage_errors(deploy, args, message):
    out = deploy("router", *args, *ZONE)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert deploy.argvs() == []


def test_a_role_needs_a_one_host_slice_and_a_known_name(deploy):
    deploy.add_vm("big", "v6e-16")
    out = deploy("serve", "--name", "big", "--kv-role", "prefill", *ZONE)
    assert out.returncode == 2 and "a prefill or decode server runs on one host" in out.stderr
    out = deploy("serve", "--name", "big", "--kv-role", "middle", *ZONE)
    assert out.returncode == 2 and "expected both, prefill or decode" in out.stderr


def test_stop_stops_the_router_first(deploy):
    deploy.add_vm("r-a", "v6e-8")
    assert deploy("stop", "--name", "r-a", *ZONE[:4]).returncode == 0
    first = ssh_commands(deploy.argvs(), "0")[0]
    assert first.startswith("sudo systemctl stop jaxinfer-router.service")


def test_dry_run_of_the_cluster_runs_no_gcloud(deploy):
    out = deploy("serve-cluster", "--replicas", "r-a,r-b", *ZONE, "--dry-run")
    assert out.returncode == 0, out.stderr
    assert deploy.argvs() == []
    assert "--worker-urls http://<r-a-worker-0-ip>:8000 http://<r-b-worker-0-ip>:8000" in out.stdout.replace('"', "")
