#!/usr/bin/env bash
# What issues 27, 30 and 31 still need measured on a 2-core AVX2-only machine (Zen 1-3, an older
# Xeon), in one command from a checkout; each part's log and figures go to $OUT (./avx2-check).
#
#   scripts/avx2_check.sh              # every part, in this order (about 1-1.5 h on a 2-core Zen 1)
#   scripts/avx2_check.sh suite tp     # some of them
#
# suite  `make test` in a fresh clone of this checkout's HEAD with an empty HOME, as CI runs it
#        (install, extension build and model pull included; target: under 15 minutes)
# tp     the tensor-parallel tests alone, two pytest processes as `make test` runs them (issue 31:
#        at most about 3 minutes)
# quant  `tandem bench quant` with llama.cpp on the same GGUF (issue 27's table; installs the
#        bench-ref extra, which compiles llama.cpp for this CPU: several minutes the first time)
# pd     `tandem bench experiment pd` (issue 30: every request of every deployment completes)
#
# On a CPU with AVX-512 it says so and goes on: the figures are then not an AVX2 machine's (cap
# the kernels with TANDEM_NATIVE_ISA=avx2 and call them a proxy, as docs/benchmarks.md does).
set -euo pipefail
OUT="$(realpath -m "${OUT:-$(dirname "$0")/../avx2-check}")"  # before the cd: as the caller meant
cd "$(dirname "$0")/.."
FAILED=0
PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(suite tp quant pd)
TP_TESTS=(tests/parity/test_tensor_parallel.py tests/parity/test_tensor_parallel_spec.py
          tests/transfer/test_tp_transfer.py tests/transfer/test_rank_reservations.py
          tests/ray/test_ray_tensor_parallel.py tests/bench/test_bench_engine_tp_smoke.py)

for part in "${PARTS[@]}"; do
    case "$part" in suite | tp | quant | pd) ;; *)
        echo "avx2_check: unknown part '$part' (suite, tp, quant, pd)" >&2
        exit 2 ;;
    esac
done
mkdir -p "$OUT"

{
    date -u
    git rev-parse --short HEAD
    lscpu | grep -E '^(Model name|CPU family|Model|Stepping|CPU\(s\)|L3)' || true
    grep -m1 -q avx512f /proc/cpuinfo && echo "NOTE: this CPU has AVX-512: not an AVX2 machine"
    grep -m1 -q ' avx2' /proc/cpuinfo || echo "NOTE: this CPU lacks AVX2"
} | tee "$OUT/machine.txt"

timed() {  # timed NAME COMMAND...: its output to $OUT/NAME.log, its wall time and rc to the screen
    local name=$1 start rc
    shift
    echo "== $name: $* (log: $OUT/$name.log)"
    start=$(date +%s)
    set +e
    "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    set -e
    echo "== $name: rc $rc, $(($(date +%s) - start)) s" | tee -a "$OUT/machine.txt"
    tail -n 3 "$OUT/$name.log"
    [ "$rc" -eq 0 ] || FAILED=1
}

install() {  # the checkout's venv, as `make install` builds it
    if ! make install >"$OUT/install.log" 2>&1; then
        echo "avx2_check: make install failed (log: $OUT/install.log)" >&2
        exit 1
    fi
}

for part in "${PARTS[@]}"; do
    case "$part" in
    suite)
        clone="$(mktemp -d)"
        git clone -q . "$clone/tandem"
        mkdir "$clone/home"
        # nothing of this machine's: no model store, pip or build cache, native build
        timed suite env -u TANDEM_HOME -u PIP_CACHE_DIR -u XDG_CACHE_HOME -u TORCH_EXTENSIONS_DIR \
            HOME="$clone/home" make -C "$clone/tandem" test
        rm -rf "$clone"
        ;;
    tp)
        install
        timed tp .venv/bin/python -m pytest -q -rs --durations=5 -n 2 --dist loadfile "${TP_TESTS[@]}"
        ;;
    quant)
        install
        timed quant-install .venv/bin/python -m pip install -q -e '.[bench-ref]'
        timed quant .venv/bin/tandem bench quant --json "$OUT/bench-quant.json"
        ;;
    pd)
        install
        timed pd .venv/bin/tandem bench experiment pd --out "$OUT/pd"
        ;;
    esac
done
echo "avx2_check: done; logs and figures in $OUT"
exit "$FAILED"
