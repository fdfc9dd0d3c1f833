#!/usr/bin/env bash
# Deploys jaxinfer on a Cloud TPU VM (one host or a multi-host slice) through
# `gcloud compute tpus tpu-vm`. Run with --help for the commands and the settings table.
#
# create -> install -> serve: create the VM (idempotent: an existing one is reported), copy the
# project (git archive HEAD) and the model to every worker and install it into a venv, then write
# one systemd unit per worker (worker i runs `jaxinfer serve --process-id i`, worker 0's internal
# IP the coordinator) and wait until worker 0's gRPC health check says SERVING. serve-cluster and
# router put several VMs (replicas, or a prefill/decode pair) behind vllm-router (lib/cluster.sh).
# Every command goes through run() / query(), so --dry-run prints them all and runs no gcloud.
set -euo pipefail

DEPLOY_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(dirname "$DEPLOY_DIR")
PROG=${0##*/}

die() {  # CODE MESSAGE...: 2 = the user's mistake, 1 = something failed
  printf '%s: error: %s\n' "$PROG" "${*:2}" >&2
  exit "$1"
}
usage_error() { die 2 "$1"; }
info() {
  local tag=""
  ((!${DRY_RUN:-0})) || tag="(dry-run) "
  printf '%s: %s%s\n' "$PROG" "$tag" "$*" >&2
}

((BASH_VERSINFO[0] >= 4)) || die 2 "bash >= 4 needed (this is $BASH_VERSION; on macOS: brew install bash)"

# shellcheck source=deploy/lib/settings.sh
source "$DEPLOY_DIR/lib/settings.sh"
# shellcheck source=deploy/lib/accelerators.sh
source "$DEPLOY_DIR/lib/accelerators.sh"
# shellcheck source=deploy/lib/remote.sh
source "$DEPLOY_DIR/lib/remote.sh"
# shellcheck source=deploy/lib/gcloud.sh
source "$DEPLOY_DIR/lib/gcloud.sh"
# shellcheck source=deploy/lib/commands.sh
source "$DEPLOY_DIR/lib/commands.sh"
# shellcheck source=deploy/lib/cluster.sh
source "$DEPLOY_DIR/lib/cluster.sh"

usage() {
  cat <<EOF
usage: $PROG COMMAND [--dry-run] [--config FILE] [SETTING FLAGS...] [-- SERVE FLAGS...]

commands:
  create          create the TPU VM (--spot | --reserved); an existing one is reported, not recreated
  install         on every worker: the project (git archive HEAD), a Python 3.12 venv with
                  jaxinfer[tpu], the model (gs:// copied with gcloud storage, a local path by scp)
  serve           one systemd unit per worker (Restart=on-failure, SIGTERM drains), then wait
                  (--wait-timeout) until worker 0's gRPC health check says SERVING
  status          the VM, the unit on each worker, worker 0's health (exit 1 unless SERVING)
  logs            journalctl of the unit on --worker I (default 0); --follow, --lines N (200)
  stop            stop the unit: worker 0 first (it drains and releases the others), then all
  delete          delete the VM (--quiet); a missing VM is reported, exit 0
  serve-command   print the exact 'jaxinfer serve' command worker --worker I runs (for rehearsals)
  serve-cluster   serve on each VM of --replicas A,B,... (or the pair --prefill P --decode D, with
                  --kv-role prefill / decode), then 'router'
  router          vllm-router (--router-version) on worker 0 of the first VM as the unit
                  jaxinfer-router.service, in front of those servers' HTTP API (--http-port):
                  --policy (--router-policy) for replicas, --vllm-pd-disaggregation for a pair

options:
  --dry-run       print every command (one a line, '+ ' and shell-quoted) instead of running it;
                  what gcloud would answer (VM existence, worker 0's IP, login user) is a placeholder
  --config FILE   JAXINFER_TPU_KEY=VALUE lines (also \$JAXINFER_TPU_CONFIG)
  --spot, --reserved   create as spot / on a reservation (same as --provisioning spot|reserved)
  -- FLAGS...     appended to every worker's 'jaxinfer serve' (e.g. -- --max-num-seqs 128)

settings (precedence: flag > environment > config file > default):
$(settings_help)

accelerator types: v6e-N and v5litepod-N (N chips: 1, 4, 8 on one host; 16 to 256 on N/4 hosts
  of 4), v4-N and v5p-N (N TensorCores, 2 a chip: N/8 hosts of 4 chips; v4-8, v5p-8 one host).
  Default --version: v6e v2-alpha-tpuv6e, v5litepod v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5,
  v4 tpu-ubuntu2204-base.

exit status: 0 ok, 1 a command (gcloud, ssh, the health wait) failed, 2 a usage error.
EOF
}

parse_args() {
  local arg key value has_value
  COMMAND=${1:-}
  [[ -n $COMMAND ]] || { usage >&2; exit 2; }
  shift
  case $COMMAND in
    -h | --help | help) usage; exit 0 ;;
    create | install | serve | status | logs | stop | delete | serve-command | serve-cluster | router) ;;
    *) usage_error "unknown command '$COMMAND' (commands: create install serve status logs stop delete serve-command serve-cluster router)" ;;
  esac
  DRY_RUN=0 CONFIG_FILE=${JAXINFER_TPU_CONFIG:-} WORKER=0 FOLLOW=0 LINES=200 EXTRA_SERVE_ARGS=()
  while (($#)); do
    arg=$1
    shift
    has_value=0 value=""
    if [[ $arg == --*=* ]]; then value=${arg#*=} arg=${arg%%=*} has_value=1; fi
    case $arg in
      -h | --help) usage; exit 0 ;;
      --dry-run) DRY_RUN=1 ;;
      --follow) FOLLOW=1 ;;
      --spot | --reserved) set_provisioning "${arg#--}" ;;
      --) EXTRA_SERVE_ARGS=("$@"); break ;;
      --*)  # every other flag takes a value: --flag VALUE or --flag=VALUE
        if ((!has_value)); then
          (($#)) || usage_error "flag $arg needs a value"
          value=$1
          shift
        fi
        case $arg in
          --config) CONFIG_FILE=$value ;;
          --worker) WORKER=$value ;;
          --lines) LINES=$value ;;
          *)
            key=$(flag_key "$arg") || usage_error "unknown flag '$arg' (see $PROG --help)"
            FLAG_VALUE[$key]=$value
            ;;
        esac
        ;;
      *) usage_error "unexpected argument '$arg' (see $PROG --help)" ;;
    esac
  done
}

set_provisioning() {
  if [[ -n ${FLAG_VALUE[PROVISIONING]+x} && ${FLAG_VALUE[PROVISIONING]} != "$1" ]]; then
    usage_error "--spot and --reserved are mutually exclusive"
  fi
  FLAG_VALUE[PROVISIONING]=$1
}

validate_settings() {
  [[ ${S[PROVISIONING]} =~ ^(standard|spot|reserved)$ ]] ||
    usage_error "$(describe_setting PROVISIONING): expected standard, spot or reserved"
  require_integer PORT 1 65535
  require_integer COORDINATOR_PORT 1 65535
  require_integer GRACE_PERIOD 0 86400
  require_integer WAIT_TIMEOUT 0 86400
  require_integer POLL_INTERVAL 0 3600
  require_integer ROUTER_PORT 1 65535
  [[ -z ${S[HTTP_PORT]} ]] || require_integer HTTP_PORT 1 65535
  [[ ${S[KV_ROLE]} =~ ^(both|prefill|decode)$ ]] || usage_error "$(describe_setting KV_ROLE): expected both, prefill or decode"
  [[ $WORKER =~ ^[0-9]+$ ]] || usage_error "--worker '$WORKER': expected a worker index (0, 1, ...)"
  [[ $LINES =~ ^[0-9]+$ ]] || usage_error "--lines '$LINES': expected a number"
  [[ ${S[REMOTE_DIR]} =~ ^/[A-Za-z0-9._/-]+$ ]] ||
    usage_error "$(describe_setting REMOTE_DIR): expected an absolute path of [A-Za-z0-9._/-]"
  local address='^[][A-Za-z0-9.:_-]+$'  # a name, an IPv4 or a bracketed IPv6 address
  [[ ${S[HOST]} =~ $address ]] || usage_error "$(describe_setting HOST): not an address"
  [[ -z ${S[COORDINATOR]} || ${S[COORDINATOR]} =~ $address ]] ||
    usage_error "$(describe_setting COORDINATOR): not an address"
  [[ -z ${S[MESH]} || ${S[MESH]} =~ ^[a-z]+=[0-9]+(,[a-z]+=[0-9]+)*$ ]] ||
    usage_error "$(describe_setting MESH): expected axis=size[,axis=size...], e.g. data=2,tensor=4"
  if [[ -n ${S[TLS_CERT]} && -z ${S[TLS_KEY]} || -z ${S[TLS_CERT]} && -n ${S[TLS_KEY]} ]]; then
    usage_error "--tls-cert and --tls-key go together"
  fi
  [[ -z ${S[MODEL]} ]] || remote_model_path >/dev/null
  if [[ -n ${S[AUTH_TOKEN_FILE]} && -n ${S[AUTH_SECRET]} ]]; then
    usage_error "--auth-token-file and --auth-secret are mutually exclusive"
  fi
}

main() {
  parse_args "$@"
  [[ -z $CONFIG_FILE ]] || read_config_file "$CONFIG_FILE"
  resolve_settings
  validate_settings
  TMP_DIR=$(mktemp -d)
  trap 'rm -rf "$TMP_DIR"' EXIT
  "cmd_${COMMAND//-/_}"
}

main "$@"
