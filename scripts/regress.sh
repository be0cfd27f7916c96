#!/usr/bin/env bash
# Every quality gate over the reference fixtures in one go, one line per gate:
#   PASS|FAIL|SKIP  <gate>  (<seconds> s)  [reason]
# Exits non-zero when any gate fails; a failing gate's last output lines are printed under it.
#
#   scripts/regress.sh [--fast] [--fixtures DIR] [--keep-logs DIR]
#
# --fast (for CI): the gates that take seconds — the same checks on fewer model files, no
# full-text perplexity, no live llama.cpp run.
# Fixtures: ../shared/reference beside the repository root (or --fixtures / $REDLITE_REFERENCE).
# The live llama.cpp gate runs only where llama-cpp-python is importable (pip install
# llama-cpp-python); `redlite selftest` only where the binary has it.
set -u
cd "$(dirname "$0")/.."

FAST=0
FIXTURES="${REDLITE_REFERENCE:-../shared/reference}"
LOGDIR=""
while [ $# -gt 0 ]; do
    case "$1" in
        --fast) FAST=1 ;;
        --fixtures) FIXTURES="$2"; shift ;;
        --keep-logs) LOGDIR="$2"; shift ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "regress.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
if [ ! -f "$FIXTURES/logits/index.json" ]; then
    echo "regress.sh: no fixtures at $FIXTURES (expected logits/index.json)" >&2
    exit 2
fi
if [ -z "$LOGDIR" ]; then
    LOGDIR="$(mktemp -d)"
    trap 'rm -rf "$LOGDIR"' EXIT
fi
mkdir -p "$LOGDIR"

REDLITE=target/release/redlite
FAILED=0
PASSED=0
SKIPPED=0

# gate NAME COMMAND... : runs COMMAND, prints one line.
gate() {
    local name="$1"; shift
    local log="$LOGDIR/$(echo "$name" | tr -c 'A-Za-z0-9_.-' '_').log"
    local t0=$SECONDS
    if "$@" >"$log" 2>&1; then
        printf 'PASS  %-34s (%d s)\n' "$name" $((SECONDS - t0))
        PASSED=$((PASSED + 1))
    else
        printf 'FAIL  %-34s (%d s)\n' "$name" $((SECONDS - t0))
        tail -n 15 "$log" | sed 's/^/      | /'
        FAILED=$((FAILED + 1))
    fi
}

skip() {
    printf 'SKIP  %-34s %s\n' "$1" "$2"
    SKIPPED=$((SKIPPED + 1))
}

cargo_test() {
    cargo test --release --quiet "$@"
}

# Shipped model files, from the fixtures' index (entries whose logits are stored).
MODELS=$(python3 - "$FIXTURES" <<'EOF'
import json, sys
idx = json.load(open(sys.argv[1] + "/logits/index.json"))
seen = []
for e in idx["entries"]:
    if e.get("exact_path") and e["model"] not in seen:
        seen.append(e["model"])
print(" ".join(seen))
EOF
)
if [ "$FAST" = 1 ]; then
    PARITY_MODELS="F16 Q4_K_M IQ2_XXS LEGACY_CF2"
else
    PARITY_MODELS="$MODELS"
fi

echo "regress: fixtures $FIXTURES, $([ "$FAST" = 1 ] && echo fast || echo full) mode"

gate "build (release)" cargo build --release --quiet -p redlite

# Container, quant formats, corrupt files.
gate "gguf: corrupt files rejected" cargo_test -p redlite-gguf --test broken
gate "gguf: dequant fixtures" cargo_test -p redlite-gguf --test dequant_fixtures --test dequant_tables

# Tokenizer and chat template.
gate "tokenizer (Qwen3 + small BPE)" cargo_test -p redlite-tokenizer --test tokenizer_qwen3 --test tokenizer_small
gate "chat template (byte-exact)" cargo_test -p redlite-tokenizer --test chat_template_fixtures

# Oracle logits bounds (every file, prefill and step, MTP, both DeltaNet layouts).
gate "logits bounds vs exact" cargo_test -p redlite-model --test oracle_logits -- \
    logits_match_exact_reference_prefill_and_step mtp_logits_match_exact_reference \
    legacy_and_split_deltanet_layouts_agree chunked_and_step_deltanet_agree
gate "greedy parity vs greedy_exact" cargo_test -p redlite-model --test oracle_logits -- \
    greedy_continuations_match_exact_reference

# KL against the stored exact logits through the CLI (README: an f32 engine stays within
# KL 1e-6; a greedy divergence is allowed only on a top-2 tie below 1e-4).
for m in $PARITY_MODELS; do
    f="$FIXTURES/models/tiny-$m.gguf"
    if [ -f "$f" ]; then
        gate "parity exact: $m" "$REDLITE" parity -m "$f" --reference exact --fixtures "$FIXTURES" \
            --max-kl-mean 1e-6 --fail-on-greedy-gap 1e-4
    else
        skip "parity exact: $m" "(no $f)"
    fi
done

# Perplexity: within 0.5 % of llama-perplexity's figures (F16, Q8_0; whole held-out text).
if [ "$FAST" = 1 ]; then
    skip "perplexity vs llama.cpp" "(--fast)"
else
    gate "perplexity vs llama.cpp" cargo_test -p redlite-engine --test perplexity
fi

# llama.cpp run live on the fixture prompts (F16: llama.cpp's own KL from exact is 1e-7).
if [ "$FAST" = 1 ]; then
    skip "parity live llama.cpp: F16" "(--fast)"
elif python3 -c "import llama_cpp" >/dev/null 2>&1; then
    gate "parity live llama.cpp: F16" "$REDLITE" parity -m "$FIXTURES/models/tiny-F16.gguf" \
        --reference live --fixtures "$FIXTURES" --max-kl-mean 2e-6 --fail-on-greedy-gap 1e-4
else
    skip "parity live llama.cpp: F16" "(llama-cpp-python not installed)"
fi

# Quantize the F16 fixture with the cf2 recipe, then load and run the result in llama.cpp.
quantized_cf2_loads_in_llamacpp() {
    local out="${TMPDIR:-/tmp}/regress-cf2-$$.gguf" r
    "$REDLITE" quantize "$FIXTURES/models/tiny-F16.gguf" "$out" --recipe cf2 \
        --imatrix "$FIXTURES/models/tiny.imatrix.gguf" --quiet &&
        python3 scripts/check_quantized_llamacpp.py "$out" --reference "$FIXTURES"
    r=$?
    rm -f "$out"
    return $r
}

# Quantize: cf2 on the F16 fixture is llama-quantize's tiny-CF2.gguf byte for byte (and KL within
# 1.5x), q4_k_m types match tiny-Q4_K_M, our imatrix has llama-imatrix's entries; in the full run
# llama.cpp must load our cf2 file.
gate "quantize + imatrix vs llama.cpp's tools" cargo_test -p redlite-engine --test quantize --test imatrix
if [ "$FAST" = 1 ]; then
    skip "quantized file loads in llama.cpp" "(--fast)"
elif python3 -c "import llama_cpp" >/dev/null 2>&1; then
    gate "quantized file loads in llama.cpp" quantized_cf2_loads_in_llamacpp
else
    skip "quantized file loads in llama.cpp" "(llama-cpp-python not installed)"
fi

# Fast kernels against the oracle.
if "$REDLITE" selftest --help >/dev/null 2>&1; then
    gate "selftest" "$REDLITE" selftest
else
    skip "selftest" "(this redlite has no selftest command)"
fi

echo "regress: $PASSED passed, $FAILED failed, $SKIPPED skipped"
[ "$FAILED" = 0 ]
