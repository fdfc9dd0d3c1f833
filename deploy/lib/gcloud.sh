# shellcheck shell=bash disable=SC2034  # SCOPES and SRC are read by the other files
# Running commands: run() for what changes something, capture() for what answers a question.
# Under --dry-run run() prints each command as '+ ' and its shell-quoted words, one a line, and
# the questions gcloud would answer (does the VM exist, worker 0's IP, the login user) are
# printed the same way and answered by placeholders, each announced by a '# dry-run:' line.

TPU_VM=(gcloud compute tpus tpu-vm)
SCOPES=https://www.googleapis.com/auth/cloud-platform  # IAM alone decides what the VM may read

show() { printf '+ %s\n' "$(quote_words "$@")"; }
note() { printf '# dry-run: %s\n' "$*"; }

run() {
  if ((DRY_RUN)); then
    show "$@"
    return 0
  fi
  local status=0
  "$@" || status=$?
  ((status == 0)) || die 1 "command failed (exit $status): $(quote_words "$@")"
}

capture() {  # sets OUT (stdout) and ERR (stderr); returns the command's status
  local status=0
  OUT=$("$@" 2>"$TMP_DIR/stderr") || status=$?
  ERR=$(<"$TMP_DIR/stderr")
  return "$status"
}

require_vm() {  # NAME, ZONE and PROJECT are needed by every gcloud call; sets VM_FLAGS
  require_setting NAME
  require_setting ZONE
  if [[ -z ${S[PROJECT]} ]]; then
    local cmd=(gcloud config get-value project)
    if ((DRY_RUN)); then
      show "${cmd[@]}"
      note "project from gcloud config: <gcloud-default-project>"
      S[PROJECT]="<gcloud-default-project>"
    else
      capture "${cmd[@]}" || die 1 "gcloud config get-value project failed: $ERR"
      S[PROJECT]=$(tr -d '[:space:]' <<<"$OUT")
      [[ -n ${S[PROJECT]} && ${S[PROJECT]} != "(unset)" ]] ||
        usage_error "missing project: pass --project, set JAXINFER_TPU_PROJECT, or gcloud config set project P"
      SRC[PROJECT]=default
    fi
  fi
  VM_FLAGS=(--zone="${S[ZONE]}" --project="${S[PROJECT]}")
}

# Sets VM_EXISTS (0/1), VM_STATE, VM_TYPE, VM_IP0 (worker 0's internal IP). A NOT_FOUND answer
# means no VM; any other failure ends the script. Dry-run: assumes the VM exists iff $1 is 1.
describe_vm() {
  local format='value(state,acceleratorType,networkEndpoints[0].ipAddress)'
  local cmd=("${TPU_VM[@]}" describe "${S[NAME]}" "${VM_FLAGS[@]}" --format="$format")
  if ((DRY_RUN)); then
    show "${cmd[@]}"
    VM_EXISTS=$1 VM_STATE=READY VM_TYPE=${S[ACCELERATOR_TYPE]} VM_IP0="<worker-0-internal-ip>"
    if ((VM_EXISTS)); then
      note "assuming ${S[NAME]} exists: state READY, type $VM_TYPE, worker 0 at $VM_IP0"
    else
      note "assuming ${S[NAME]} does not exist yet"
    fi
    return 0
  fi
  if capture "${cmd[@]}"; then
    VM_EXISTS=1
    IFS=$'\t' read -r VM_STATE VM_TYPE VM_IP0 <<<"$OUT" || true
  elif [[ $ERR == *NOT_FOUND* ]]; then
    VM_EXISTS=0
  else
    die 1 "gcloud describe of ${S[NAME]} failed: ${ERR:-no message}"
  fi
}

vm_ip() {  # NAME: sets NAMED_IP, worker 0's internal IP of that TPU VM (which must be READY)
  local format='value(state,networkEndpoints[0].ipAddress)' state
  local cmd=("${TPU_VM[@]}" describe "$1" "${VM_FLAGS[@]}" --format="$format")
  if ((DRY_RUN)); then
    show "${cmd[@]}"
    NAMED_IP="<$1-worker-0-ip>"
    note "assuming $1 is READY, worker 0 at $NAMED_IP"
    return 0
  fi
  capture "${cmd[@]}" || die 1 "TPU VM $1: gcloud describe failed: ${ERR:-no message}"
  IFS=$'\t' read -r state NAMED_IP <<<"$OUT" || true
  [[ $state == READY && -n $NAMED_IP ]] || die 1 "TPU VM $1 is ${state:-unknown}, not READY"
}

require_ready_vm() {
  describe_vm 1
  ((VM_EXISTS)) || die 1 "TPU VM ${S[NAME]} not found in zone ${S[ZONE]} (run: $PROG create)"
  [[ $VM_STATE == READY ]] || die 1 "TPU VM ${S[NAME]} is $VM_STATE, not READY"
}

# ACC_* and the default mesh of the slice; the VM's own type wins over the setting. On several
# hosts the default depends on whether the model's weights fit one host (default_mesh).
use_accelerator() {
  local type=$1 bytes=0
  parse_accelerator "$type" || usage_error "unknown accelerator type '$type': expected $ACCELERATOR_HELP"
  [[ -z ${S[MESH]} ]] || return 0
  if ((ACC_HOSTS > 1)); then
    model_bytes
    bytes=$MODEL_BYTES
  fi
  S[MESH]=$(default_mesh "$bytes")
  if [[ ${S[MESH]} == stage=* ]]; then
    info "the model's $((bytes / 1024 / 1024 / 1024)) GiB of weights pass $HOST_WEIGHTS_PERCENT% of one host's" \
      "$((ACC_CHIPS_PER_HOST * $(chip_hbm_gib))) GiB of HBM: one pipeline stage per host (--mesh ${S[MESH]})"
  fi
}

# Sets MODEL_BYTES: the size of the MODEL setting's files (gs://: `gcloud storage du`; a local
# path: du; none: the embedded SmolLM2, small). Dry-run: shows the gcloud call, assumes small.
model_bytes() {
  local model=${S[MODEL]%/} cmd=(gcloud storage du -s "${S[MODEL]%/}")
  MODEL_BYTES=0
  if [[ $model == gs://* ]] && ((DRY_RUN)); then
    show "${cmd[@]}"
    note "assuming the model's weights fit one host (else the default mesh is stage=$ACC_HOSTS,...)"
  elif [[ $model == gs://* ]]; then
    capture "${cmd[@]}" || die 1 "gcloud storage du $model failed: ${ERR:-no message}"
    read -r MODEL_BYTES _ <<<"$OUT" || true
  elif [[ -n $model && -e $model ]]; then
    read -r MODEL_BYTES _ < <(du -sk "$model")
    MODEL_BYTES=$((MODEL_BYTES * 1024))
  fi
  [[ $MODEL_BYTES =~ ^[0-9]+$ ]] || die 1 "could not read the size of $model (got '$MODEL_BYTES')"
}

ssh_on() {  # WORKER(index or all) COMMAND
  run "${TPU_VM[@]}" ssh "${S[NAME]}" "${VM_FLAGS[@]}" --worker="$1" --command="$2"
}

scp_to() {  # WORKER LOCAL_PATH REMOTE_PATH [gcloud scp flags]
  run "${TPU_VM[@]}" scp "${@:4}" "$2" "${S[NAME]}:$3" "${VM_FLAGS[@]}" --worker="$1"
}

login_user() {  # sets LOGIN_USER: whom gcloud ssh logs in as (the unit runs as that user)
  local cmd=("${TPU_VM[@]}" ssh "${S[NAME]}" "${VM_FLAGS[@]}" --worker=0 --command="id -un")
  if ((DRY_RUN)); then
    show "${cmd[@]}"
    note "login user: <login-user>"
    LOGIN_USER="<login-user>"
    return 0
  fi
  capture "${cmd[@]}" || die 1 "ssh to worker 0 failed: $ERR"
  LOGIN_USER=$(grep -v '^[[:space:]]*$' <<<"$OUT" | tail -n 1 | tr -d '[:space:]')
  [[ $LOGIN_USER =~ ^[a-z_][a-z0-9_.-]*$ ]] || die 1 "unexpected login user from worker 0: '$OUT'"
}
