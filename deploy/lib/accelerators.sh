# shellcheck shell=bash disable=SC2034  # ACC_* and ACCELERATOR_HELP are read by the other files
# TPU accelerator types -> chips, hosts (workers) and the default runtime version.
#
#   type           N counts      valid N                        hosts                chips/host
#   v4-N, v5p-N    TensorCores   8, 16, 24, ... (multiples      N/8 (2 cores a chip,  4
#                  (2 per chip)  of 8; v4 <= 4096, v5p <= 12288)  4 chips a host)
#   v5litepod-N,   chips         1, 4, 8                        1                    N
#   v6e-N                        16, 32, 64, 128, 256           N/4                  4
#
# So v4-8 and v5p-8 are one host of 4 chips, v4-16 and v5p-16 two hosts; v5litepod-8 and v6e-8
# are one host of 8 chips, v5litepod-16 and v6e-16 four hosts of 4 chips.

ACCELERATOR_HELP="v4-N or v5p-N (N = TensorCores, a multiple of 8: v4-8, v5p-16, ...), \
v5litepod-N or v6e-N (N in 1, 4, 8, 16, 32, 64, 128, 256)"

# Sets ACC_GENERATION, ACC_CHIPS, ACC_HOSTS, ACC_CHIPS_PER_HOST, ACC_VERSION; status 1 if unknown.
parse_accelerator() {
  local n max
  [[ $1 =~ ^(v4|v5p|v5litepod|v6e)-([1-9][0-9]{0,5})$ ]] || return 1
  ACC_GENERATION=${BASH_REMATCH[1]} n=${BASH_REMATCH[2]}
  case $ACC_GENERATION in
    v4 | v5p)
      max=4096
      [[ $ACC_GENERATION != v5p ]] || max=12288
      ((n % 8 == 0 && n <= max)) || return 1
      ACC_CHIPS=$((n / 2)) ACC_CHIPS_PER_HOST=4
      ;;
    v5litepod | v6e)
      case $n in
        1 | 4 | 8) ACC_CHIPS_PER_HOST=$n ;;
        16 | 32 | 64 | 128 | 256) ACC_CHIPS_PER_HOST=4 ;;
        *) return 1 ;;
      esac
      ACC_CHIPS=$n
      ;;
  esac
  ACC_HOSTS=$((ACC_CHIPS / ACC_CHIPS_PER_HOST))
  case $ACC_GENERATION in
    v6e) ACC_VERSION=v2-alpha-tpuv6e ;;
    v5litepod) ACC_VERSION=v2-alpha-tpuv5-lite ;;
    v5p) ACC_VERSION=v2-alpha-tpuv5 ;;
    v4) ACC_VERSION=tpu-ubuntu2204-base ;;
  esac
}

# HBM of one chip of the generation, in GiB.
chip_hbm_gib() {
  case $ACC_GENERATION in
    v4 | v6e) echo 32 ;;
    v5p) echo 95 ;;
    v5litepod) echo 16 ;;
  esac
}

# Weights may take this percentage of a host's HBM and still leave it room for the KV cache.
HOST_WEIGHTS_PERCENT=70

# Whether weights of $1 bytes fit one host of the slice (HOST_WEIGHTS_PERCENT of its HBM).
fits_one_host() {
  local host=$((ACC_CHIPS_PER_HOST * $(chip_hbm_gib) * 1024 * 1024 * 1024))
  (($1 * 100 <= host * HOST_WEIGHTS_PERCENT))
}

# The mesh every worker passes to `jaxinfer serve` unless --mesh says otherwise, given the
# model's weights in bytes ($1; 0 or absent: small): one host is tensor-parallel over its chips;
# several hosts run one replica per host (data=H), so tensor collectives stay on a host's
# interconnect, unless the weights do not fit one host: then one pipeline stage per host
# (stage=H), each host's chips tensor-parallel, and only activations cross between hosts.
default_mesh() {
  if ((ACC_HOSTS == 1)); then
    printf 'tensor=%s\n' "$ACC_CHIPS"
  elif fits_one_host "${1:-0}"; then
    printf 'data=%s,tensor=%s\n' "$ACC_HOSTS" "$ACC_CHIPS_PER_HOST"
  else
    printf 'stage=%s,tensor=%s\n' "$ACC_HOSTS" "$ACC_CHIPS_PER_HOST"
  fi
}
