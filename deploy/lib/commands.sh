# shellcheck shell=bash disable=SC2153  # UNIT, WORKER, FOLLOW, ... are globals of the other files
# The subcommands of deploy/tpu_vm.sh, one function each (cmd_<name>).

cmd_create() {
  require_vm
  use_accelerator "${S[ACCELERATOR_TYPE]}"
  local version=${S[VERSION]:-$ACC_VERSION}
  describe_vm 0
  if ((VM_EXISTS)); then
    info "TPU VM ${S[NAME]} already exists, state $VM_STATE ($VM_TYPE); not recreating"
    [[ $VM_TYPE == "${S[ACCELERATOR_TYPE]}" || ${SRC[ACCELERATOR_TYPE]} == default ]] ||
      info "warning: it is $VM_TYPE, not ${S[ACCELERATOR_TYPE]}; delete it first to change the type"
    return 0
  fi
  local cmd=("${TPU_VM[@]}" create "${S[NAME]}" "${VM_FLAGS[@]}" --accelerator-type="${S[ACCELERATOR_TYPE]}"
    --version="$version" --scopes="$SCOPES")
  [[ ${S[PROVISIONING]} == standard ]] || cmd+=("--${S[PROVISIONING]}")
  [[ -z ${S[SERVICE_ACCOUNT]} ]] || cmd+=(--service-account="${S[SERVICE_ACCOUNT]}")
  info "creating ${S[NAME]}: ${S[ACCELERATOR_TYPE]} = $ACC_HOSTS host(s) x $ACC_CHIPS_PER_HOST chips," \
    "runtime $version, ${S[PROVISIONING]}"
  run "${cmd[@]}"
  info "created ${S[NAME]}; next: $PROG install"
}

cmd_install() {
  require_vm
  local model=${S[MODEL]} archive="$TMP_DIR/jaxinfer-src.tar.gz" dir=${S[REMOTE_DIR]}
  if [[ -n $model ]]; then
    [[ $model == gs://* || -e $model ]] || usage_error "$(describe_setting MODEL): no such file or directory"
  fi
  if ((!DRY_RUN)); then
    git -C "$REPO_ROOT" rev-parse --verify -q HEAD >/dev/null || die 1 "$REPO_ROOT: not a git checkout with a commit"
    [[ -z $(git -C "$REPO_ROOT" status --porcelain --untracked-files=no) ]] ||
      info "warning: uncommitted changes in $REPO_ROOT are not installed (git archive HEAD)"
  fi
  ssh_on all "$(remote_prepare_cmd)"
  run git -C "$REPO_ROOT" archive --format=tar.gz -o "$archive" HEAD
  scp_to all "$archive" "$dir/jaxinfer-src.tar.gz"
  ssh_on all "$(remote_install_cmd)"
  if [[ $model == gs://* ]]; then
    ssh_on all "$(remote_model_gs_cmd)"
  elif [[ -n $model ]]; then
    ssh_on all "rm -rf $(q "$(remote_model_path)")"
    scp_to all "$model" "$dir/models/" --recurse
  fi
  info "installed on every worker of ${S[NAME]}; next: $PROG serve"
}

# Token and TLS files into REMOTE_DIR/secrets on every worker (every worker's unit names them).
stage_secrets() {
  local secrets="${S[REMOTE_DIR]}/secrets" files=()
  [[ -n ${S[AUTH_TOKEN_FILE]}${S[AUTH_SECRET]}${S[TLS_CERT]} ]] || return 0
  ssh_on all "set -e; umask 077; mkdir -p $(q "$secrets"); chmod 700 $(q "$secrets")"
  if [[ -n ${S[AUTH_TOKEN_FILE]} ]]; then
    scp_to all "${S[AUTH_TOKEN_FILE]}" "$secrets/token"
    files+=("$secrets/token")
  elif [[ -n ${S[AUTH_SECRET]} ]]; then
    ssh_on all "$(remote_secret_cmd)"
  fi
  if [[ -n ${S[TLS_CERT]} ]]; then
    scp_to all "${S[TLS_CERT]}" "$secrets/tls.crt"
    scp_to all "${S[TLS_KEY]}" "$secrets/tls.key"
    files+=("$secrets/tls.crt" "$secrets/tls.key")
  fi
  ((${#files[@]} == 0)) || ssh_on all "chmod 600 $(quote_words "${files[@]}")"
}

check_local_files() {
  local key
  for key in AUTH_TOKEN_FILE TLS_CERT TLS_KEY; do
    [[ -z ${S[$key]} || -f ${S[$key]} ]] || usage_error "$(describe_setting "$key"): no such file"
  done
}

cmd_serve() {
  require_vm
  check_local_files
  require_ready_vm
  [[ ${SRC[ACCELERATOR_TYPE]} == default || ${S[ACCELERATOR_TYPE]} == "$VM_TYPE" ]] ||
    info "warning: ${S[NAME]} is $VM_TYPE; ignoring $(describe_setting ACCELERATOR_TYPE)"
  use_accelerator "$VM_TYPE"
  local coordinator=${S[COORDINATOR]:-$VM_IP0} worker unit
  ((ACC_HOSTS == 1)) || info "$VM_TYPE: $ACC_HOSTS hosts; coordinator $coordinator:${S[COORDINATOR_PORT]}"
  [[ -n ${S[AUTH_TOKEN_FILE]}${S[AUTH_SECRET]} ]] ||
    info "warning: no auth token (--auth-token-file or --auth-secret): anyone reaching port ${S[PORT]} may call"
  login_user
  stage_secrets
  # Worker 0 first: it drains its calls and then releases the other processes, which exit.
  ssh_on 0 "sudo systemctl stop $UNIT 2>/dev/null || true"
  # One host: the engine built once with the service's flags (every step variant compiled, or read,
  # and kept in the executable store and JAX's cache), so the service starts by loading them.
  if ((ACC_HOSTS == 1)); then
    serve_argv 0 "$coordinator" "$VM_IP0"
    ssh_on 0 "cd $(q "${S[REMOTE_DIR]}") && $(quote_words "${SERVE_ARGV[@]}" --warm-up-only)"
  fi
  for ((worker = 0; worker < ACC_HOSTS; worker++)); do
    unit="$TMP_DIR/jaxinfer-worker-$worker.service"
    unit_text "$worker" "$coordinator" "$LOGIN_USER" "$VM_IP0" >"$unit"
    if ((DRY_RUN)); then
      note "$unit, the unit of worker $worker:"
      sed 's/^/#   /' "$unit"
    fi
    scp_to "$worker" "$unit" "${S[REMOTE_DIR]}/$UNIT"
    ssh_on "$worker" "$(remote_unit_install_cmd)"
  done
  wait_serving
  info "serving on ${VM_IP0}:${S[PORT]} (worker 0, inside the VPC);" \
    "try: jaxinfer client --server ${VM_IP0}:${S[PORT]} health"
}

# Polls worker 0's gRPC health check until it says SERVING; exit 1 after WAIT_TIMEOUT seconds.
wait_serving() {
  local cmd=("${TPU_VM[@]}" ssh "${S[NAME]}" "${VM_FLAGS[@]}" --worker=0 --command="$(remote_health_cmd)")
  local timeout=$((10#${S[WAIT_TIMEOUT]})) interval=$((10#${S[POLL_INTERVAL]})) start=$SECONDS
  local attempt=0 last
  if ((DRY_RUN)); then
    show "${cmd[@]}"
    note "repeated every ${interval}s until it prints SERVING, for at most ${timeout}s"
    return 0
  fi
  while :; do
    attempt=$((attempt + 1))
    if capture "${cmd[@]}" && grep -qx 'SERVING' <<<"$OUT"; then
      info "worker 0 is SERVING (after $((SECONDS - start))s, $attempt health check(s))"
      return 0
    fi
    last=$(printf '%s\n%s\n' "$OUT" "$ERR" | grep -v '^[[:space:]]*$' | tail -n 1 || true)
    if ((SECONDS - start >= timeout)); then
      die 1 "worker 0 not SERVING after ${timeout}s ($attempt checks; last: ${last:-no output});" \
        "see: $PROG logs --worker 0"
    fi
    info "waiting for worker 0 to be SERVING ($((SECONDS - start))s of ${timeout}s, check $attempt): ${last:-no output}"
    sleep "$interval"
  done
}

cmd_serve_command() {
  local coordinator=${S[COORDINATOR]}
  if [[ ${SRC[ACCELERATOR_TYPE]} == default ]]; then
    require_vm
    require_ready_vm
    use_accelerator "$VM_TYPE"
    coordinator=${coordinator:-$VM_IP0}
  else
    use_accelerator "${S[ACCELERATOR_TYPE]}"
    if ((ACC_HOSTS > 1)) && [[ -z $coordinator ]]; then
      require_vm
      require_ready_vm
      coordinator=$VM_IP0
    fi
  fi
  ((10#$WORKER < ACC_HOSTS)) || usage_error "--worker $WORKER: the slice has workers 0..$((ACC_HOSTS - 1))"
  check_local_files
  if [[ ${S[KV_ROLE]} != both && -z ${VM_IP0:-} ]]; then  # the address its KV pages are offered at
    require_vm
    require_ready_vm
  fi
  serve_argv "$((10#$WORKER))" "$coordinator" "${VM_IP0:-}"
  quote_words "${SERVE_ARGV[@]}"
}

cmd_status() {
  require_vm
  describe_vm 1
  ((VM_EXISTS)) || die 1 "TPU VM ${S[NAME]} not found in zone ${S[ZONE]}"
  ((DRY_RUN)) || printf '%s: state %s, %s, worker 0 at %s\n' "${S[NAME]}" "$VM_STATE" "$VM_TYPE" "$VM_IP0"
  ssh_on all "echo \"\$(hostname): $UNIT \$(systemctl is-active $UNIT || true)\""
  local cmd=("${TPU_VM[@]}" ssh "${S[NAME]}" "${VM_FLAGS[@]}" --worker=0 --command="$(remote_health_cmd)")
  if ((DRY_RUN)); then
    show "${cmd[@]}"
    return 0
  fi
  if capture "${cmd[@]}" && grep -qx 'SERVING' <<<"$OUT"; then
    echo "worker 0 health: SERVING"
    return 0
  fi
  echo "worker 0 health: $(printf '%s\n%s\n' "$OUT" "$ERR" | grep -v '^[[:space:]]*$' | tail -n 1 || true)"
  return 1
}

cmd_logs() {
  require_vm
  local follow=""
  ((!FOLLOW)) || follow=" --follow"
  ssh_on "$((10#$WORKER))" "sudo journalctl -u $UNIT --no-pager --lines=$((10#$LINES))$follow"
}

cmd_stop() {
  require_vm
  # Worker 0 drains (health NOT_SERVING, in-flight calls get the grace period), then releases
  # the other processes; stopping a follower first would leave worker 0 waiting on it.
  ssh_on 0 "sudo systemctl stop jaxinfer-router.service 2>/dev/null || true; sudo systemctl stop $UNIT"
  ssh_on all "sudo systemctl stop $UNIT"
  info "stopped $UNIT on every worker of ${S[NAME]}"
}

cmd_delete() {
  require_vm
  describe_vm 1
  if ((!VM_EXISTS)); then
    info "TPU VM ${S[NAME]} not found in zone ${S[ZONE]}; nothing to delete"
    return 0
  fi
  run "${TPU_VM[@]}" delete "${S[NAME]}" "${VM_FLAGS[@]}" --quiet
  info "deleted ${S[NAME]}"
}
