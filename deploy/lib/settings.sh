# shellcheck shell=bash
# Settings of deploy/tpu_vm.sh: one table, four sources, one precedence.
#
#   flag (--zone Z)  >  environment (JAXINFER_TPU_ZONE=Z)  >  config file (JAXINFER_TPU_ZONE=Z)  >  default
#
# Every setting KEY has the flag --key (lower case, '_' -> '-'), the environment variable and
# config-file key JAXINFER_TPU_KEY, and a default. The config file holds KEY=VALUE lines; '#'
# starts a comment line; a value may be wrapped in one pair of quotes; nothing is evaluated.
# An empty environment variable or config value counts as unset; an empty flag does not.

# KEY|DEFAULT|DESCRIPTION (a default in <angle brackets> is computed, see the description)
SETTING_TABLE=(
  "NAME||TPU VM name (required)"
  "ZONE||zone, e.g. us-east5-b (required)"
  "PROJECT|<gcloud config>|default: gcloud config get-value project"
  "ACCELERATOR_TYPE|v6e-8|for create; the others use the VM's type (see below)"
  "VERSION|<per generation>|runtime version; default per generation (see below)"
  "PROVISIONING|standard|standard, spot (--spot) or reserved (--reserved)"
  "SERVICE_ACCOUNT||the VM's service account (create); default: Compute Engine's"
  "MODEL||gs://BUCKET/PATH or a local path; default: the embedded SmolLM2"
  "PORT|50051|gRPC port of the server on worker 0"
  "HOST|0.0.0.0|address the server listens on"
  "MESH|<per slice>|1 host: tensor=<chips>; H hosts: data=H,tensor=4 (stage=H,tensor=4 if the weights pass 70% of a host's HBM)"
  "COORDINATOR|<worker 0 IP>|multi-host coordinator host (worker 0's internal IP)"
  "COORDINATOR_PORT|8476|multi-host coordinator port"
  "AUTH_TOKEN_FILE||local token file, copied to the workers (mode 600)"
  "AUTH_SECRET||Secret Manager secret with the token, read on the workers"
  "TLS_CERT||local PEM certificate chain: serve TLS"
  "TLS_KEY||local PEM private key of --tls-cert"
  "TLS_SERVER_NAME||name the health check expects in the certificate"
  "GRACE_PERIOD|30|drain seconds on SIGTERM (TimeoutStopSec: this + 30)"
  "WAIT_TIMEOUT|900|seconds serve waits for the health check's SERVING"
  "POLL_INTERVAL|15|seconds between health checks"
  "REMOTE_DIR|/opt/jaxinfer|on the workers: src/ venv/ models/ secrets/"
  "SERVE_ARGS||more 'jaxinfer serve' flags, split at whitespace"
  "HTTP_PORT|<8000 in a cluster>|OpenAI HTTP API port on worker 0 (serve: none unless given)"
  "KV_ROLE|both|disaggregated prefill/decode: both, prefill or decode (one-host slices)"
  "REPLICAS||serve-cluster, router: TPU VMs of replicas, comma-separated"
  "PREFILL||serve-cluster, router: the TPU VM computing prompts (with --decode)"
  "DECODE||serve-cluster, router: the TPU VM decoding them (with --prefill)"
  "ROUTER_PORT|8080|vllm-router's port on worker 0 of the first VM"
  "ROUTER_POLICY|power_of_two|vllm-router's --policy for replicas"
  "ROUTER_VERSION|0.1.17|the vllm-router release installed (router)"
)

declare -A SETTING_DEFAULT=() FLAG_VALUE=() CONFIG_VALUE=() S=() SRC=()
SETTING_KEYS=()
for _row in "${SETTING_TABLE[@]}"; do
  IFS='|' read -r _key _default _ <<<"$_row"
  SETTING_KEYS+=("$_key")
  SETTING_DEFAULT[$_key]=$_default
done
unset _row _key _default

# --accelerator-type -> ACCELERATOR_TYPE; prints nothing (status 1) for a flag that is no setting.
flag_key() {
  local key
  key=$(tr 'a-z-' 'A-Z_' <<<"${1#--}")
  [[ -n ${SETTING_DEFAULT[$key]+x} ]] || return 1
  printf '%s\n' "$key"
}

settings_help() {
  local row key default description
  printf '  %-19s %-30s %-16s %s\n' FLAG "ENV / CONFIG KEY" DEFAULT DESCRIPTION
  for row in "${SETTING_TABLE[@]}"; do
    IFS='|' read -r key default description <<<"$row"
    printf '  %-19s %-30s %-16s %s\n' "--$(tr 'A-Z_' 'a-z-' <<<"$key")" "JAXINFER_TPU_$key" \
      "${default:--}" "$description"
  done
}

read_config_file() {
  local file=$1 line key value number=0
  [[ -f $file && -r $file ]] || usage_error "config file '$file' does not exist or is not readable"
  while IFS= read -r line || [[ -n $line ]]; do
    number=$((number + 1))
    line=${line%$'\r'}
    [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
    [[ $line =~ ^[[:space:]]*JAXINFER_TPU_([A-Z_]+)=(.*)$ ]] ||
      usage_error "$file:$number: expected JAXINFER_TPU_KEY=VALUE, got '$line'"
    key=${BASH_REMATCH[1]} value=${BASH_REMATCH[2]}
    [[ -n ${SETTING_DEFAULT[$key]+x} ]] || usage_error "$file:$number: unknown key JAXINFER_TPU_$key"
    if [[ $value =~ ^\"(.*)\"$ || $value =~ ^\'(.*)\'$ ]]; then value=${BASH_REMATCH[1]}; fi
    [[ -z $value ]] || CONFIG_VALUE[$key]=$value
  done <"$file"
}

# Fills S[KEY] (the value) and SRC[KEY] (flag, env, config or default) by the precedence above.
resolve_settings() {
  local key env
  for key in "${SETTING_KEYS[@]}"; do
    env="JAXINFER_TPU_$key"
    if [[ -n ${FLAG_VALUE[$key]+x} ]]; then
      S[$key]=${FLAG_VALUE[$key]} SRC[$key]=flag
    elif [[ -n ${!env:-} ]]; then
      S[$key]=${!env} SRC[$key]=env
    elif [[ -n ${CONFIG_VALUE[$key]+x} ]]; then
      S[$key]=${CONFIG_VALUE[$key]} SRC[$key]=config
    else
      S[$key]=${SETTING_DEFAULT[$key]} SRC[$key]=default
      [[ ${S[$key]} != '<'* ]] || S[$key]=""  # computed later
    fi
  done
}

# "zone 'x' (from env JAXINFER_TPU_ZONE)": names a value and where it came from, for errors.
describe_setting() {
  local key=$1 where
  case ${SRC[$key]} in
    flag) where="flag --$(tr 'A-Z_' 'a-z-' <<<"$key")" ;;
    env | config) where="${SRC[$key]} JAXINFER_TPU_$key" ;;
    *) where="default" ;;
  esac
  printf "%s '%s' (from %s)" "$(tr 'A-Z_' 'a-z ' <<<"$key")" "${S[$key]}" "$where"
}

require_setting() {
  local key=$1 flag
  flag="--$(tr 'A-Z_' 'a-z-' <<<"$key")"
  [[ -n ${S[$key]} ]] ||
    usage_error "missing $(tr 'A-Z_' 'a-z ' <<<"$key"): pass $flag, set JAXINFER_TPU_$key, or put it in --config FILE"
}

require_integer() {  # KEY MIN MAX
  local key=$1 min=$2 max=$3 value=${S[$1]}
  if ! [[ $value =~ ^[0-9]{1,9}$ ]] || ((10#$value < min || 10#$value > max)); then
    usage_error "$(describe_setting "$key"): must be an integer in [$min, $max]"
  fi
}
