# shellcheck shell=bash disable=SC2153  # S, VM_IP0, LOGIN_USER, ... are globals of the other files
# Several TPU VMs behind vllm-router: N replicas (--replicas a,b,c) or a disaggregated
# prefill/decode pair (--prefill p --decode d). Each VM serves as `serve` makes it serve (its own
# units; the pair's servers with --kv-role and --kv-transfer-host = their worker 0's internal
# IP), and the router runs on worker 0 of the first VM listed, as the unit jaxinfer-router.service
# (vllm-router from PyPI in REMOTE_DIR/router, a venv of its own), reaching each server's OpenAI
# HTTP API at worker 0's internal IP and HTTP_PORT.
#
#   serve-cluster   serve on every VM (in order, each until SERVING), then router
#   router          the router alone (the servers already up)

ROUTER_UNIT=jaxinfer-router.service

# CLUSTER_NAMES / CLUSTER_ROLES: the VMs and their kv roles, from REPLICAS or PREFILL + DECODE.
cluster_members() {
  local names=${S[REPLICAS]} name
  CLUSTER_NAMES=() CLUSTER_ROLES=()
  if [[ -n $names && -n ${S[PREFILL]}${S[DECODE]} ]]; then
    usage_error "--replicas and --prefill/--decode are two topologies: give one"
  fi
  if [[ -n ${S[PREFILL]}${S[DECODE]} ]]; then
    [[ -n ${S[PREFILL]} && -n ${S[DECODE]} ]] || usage_error "--prefill and --decode go together"
    [[ ${S[PREFILL]} != "${S[DECODE]}" ]] || usage_error "--prefill and --decode must be two TPU VMs"
    CLUSTER_NAMES=("${S[PREFILL]}" "${S[DECODE]}") CLUSTER_ROLES=(prefill decode)
  else
    [[ -n $names ]] || usage_error "missing the servers: pass --replicas A,B,... or --prefill P --decode D"
    IFS=',' read -ra CLUSTER_NAMES <<<"$names"
    for name in "${CLUSTER_NAMES[@]}"; do CLUSTER_ROLES+=(both); done
  fi
  for name in "${CLUSTER_NAMES[@]}"; do
    [[ $name =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] || usage_error "'$name': not a TPU VM name ([a-z][-a-z0-9]*)"
  done
  [[ -n ${S[HTTP_PORT]} ]] || S[HTTP_PORT]=8000  # a router reaches the servers over HTTP
  [[ ${S[ROUTER_POLICY]} =~ ^(random|round_robin|cache_aware|power_of_two|consistent_hash)$ ]] ||
    usage_error "$(describe_setting ROUTER_POLICY): expected random, round_robin, cache_aware, power_of_two or consistent_hash"
  [[ ${S[ROUTER_VERSION]} =~ ^[0-9]+(\.[0-9]+)*$ ]] || usage_error "$(describe_setting ROUTER_VERSION): not a release"
}

cmd_serve_cluster() {
  cluster_members
  S[NAME]=${CLUSTER_NAMES[0]}
  require_vm
  local i first=${CLUSTER_NAMES[0]} mesh=${S[MESH]}
  for i in "${!CLUSTER_NAMES[@]}"; do
    S[NAME]=${CLUSTER_NAMES[$i]} S[KV_ROLE]=${CLUSTER_ROLES[$i]} S[MESH]=$mesh
    info "serving on ${S[NAME]} (${S[KV_ROLE]})"
    cmd_serve
  done
  S[NAME]=$first
  cmd_router
}

# ROUTER_ARGV: the router's command line on worker 0 (each server's URL from its describe).
router_argv() {
  local name urls=()
  for name in "${CLUSTER_NAMES[@]}"; do
    vm_ip "$name"
    urls+=("http://$NAMED_IP:${S[HTTP_PORT]}")
  done
  ROUTER_ARGV=("${S[REMOTE_DIR]}/router/bin/python" -m vllm_router.launch_router --host 0.0.0.0
    --port "${S[ROUTER_PORT]}")
  if [[ ${CLUSTER_ROLES[0]} == prefill ]]; then
    ROUTER_ARGV+=(--vllm-pd-disaggregation --prefill "${urls[0]}" --decode "${urls[1]}")
  else
    ROUTER_ARGV+=(--worker-urls "${urls[@]}" --policy "${S[ROUTER_POLICY]}")
  fi
}

cmd_router() {
  cluster_members
  S[NAME]=${CLUSTER_NAMES[0]}
  require_vm
  require_ready_vm
  login_user
  router_argv
  local unit="$TMP_DIR/$ROUTER_UNIT"
  router_unit_text "$LOGIN_USER" >"$unit"
  if ((DRY_RUN)); then
    note "$unit, the router's unit:"
    sed 's/^/#   /' "$unit"
  fi
  ssh_on 0 "$(remote_router_install_cmd)"
  scp_to 0 "$unit" "${S[REMOTE_DIR]}/$ROUTER_UNIT"
  ssh_on 0 "$(remote_unit_install_cmd "$ROUTER_UNIT")"
  wait_router
  info "vllm-router on ${VM_IP0}:${S[ROUTER_PORT]} (worker 0 of ${S[NAME]}) in front of ${CLUSTER_NAMES[*]}"
}

remote_router_install_cmd() {
  local d
  d=$(q "${S[REMOTE_DIR]}")
  printf '%s' "set -e; cd $d; UV=\"\$HOME/.local/bin/uv\";" \
    " [ -x \"\$UV\" ] || python3 -m pip install --user --quiet uv ||" \
    " python3 -m pip install --user --quiet --break-system-packages uv;" \
    " [ -x router/bin/python ] || \"\$UV\" venv --python 3.12 router;" \
    " \"\$UV\" pip install --python router/bin/python $(q "vllm-router==${S[ROUTER_VERSION]}");" \
    " router/bin/python -m vllm_router.launch_router --help >/dev/null; echo \"vllm-router installed on \$(hostname)\""
}

router_unit_text() {  # USER
  unit_file "vllm-router in front of jaxinfer servers (${CLUSTER_NAMES[*]})" "$1" "SyslogIdentifier=jaxinfer-router" \
    "${ROUTER_ARGV[@]}"
}

# The router's /health answers 200 once its servers are up; polled like the servers' health.
remote_router_health_cmd() {
  local probe="import urllib.request as u; u.urlopen(\"http://127.0.0.1:${S[ROUTER_PORT]}/health\", timeout=5); print(\"ROUTER-OK\")"
  printf '%s' "$(q "${S[REMOTE_DIR]}/router/bin/python") -c $(q "$probe")"
}

wait_router() {
  local cmd=("${TPU_VM[@]}" ssh "${S[NAME]}" "${VM_FLAGS[@]}" --worker=0 --command="$(remote_router_health_cmd)")
  local timeout=$((10#${S[WAIT_TIMEOUT]})) interval=$((10#${S[POLL_INTERVAL]})) start=$SECONDS
  if ((DRY_RUN)); then
    show "${cmd[@]}"
    note "repeated every ${interval}s until it prints ROUTER-OK, for at most ${timeout}s"
    return 0
  fi
  until capture "${cmd[@]}" && grep -qx 'ROUTER-OK' <<<"$OUT"; do
    ((SECONDS - start < timeout)) ||
      die 1 "vllm-router not healthy after ${timeout}s; see: $PROG logs --name ${S[NAME]} (sudo journalctl -u $ROUTER_UNIT)"
    info "waiting for vllm-router ($((SECONDS - start))s of ${timeout}s)"
    sleep "$interval"
  done
  info "vllm-router is healthy (after $((SECONDS - start))s)"
}
