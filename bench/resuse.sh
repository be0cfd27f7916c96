#!/usr/bin/env bash
# Register use of the decode kernels as the GPU machine's compiler sees them (no GPU needed).
#
#   bench/resuse.sh [NVRTC_LIB_DIR] [KERNEL_REGEX]
#
# NVRTC versions allocate registers differently (session 17: dn_fused_cols got 168 registers and
# no stack from NVRTC 13.5, 128 and 58 spill instructions from 13.0, the H200 machine's), so check
# with the device's version. Without NVRTC_LIB_DIR the script fetches nvidia-cuda-nvrtc 13.0.* from
# PyPI into /tmp/nvrtc130 and uses that. Needs the `cuda` feature's test build and pip packages
# nvidia-cuda-cuobjdump (resource usage) and, for the spill count, nvidia-cuda-nvdisasm.
# Prints each matching kernel's registers and stack, and the SpillRefill instructions in its SASS.
set -euo pipefail
cd "$(dirname "$0")/.."
LIB=${1:-}
RE=${2:-'dn_fused_cols|dn_fused_seq|moe_route_gate_up_q8q_iq2_xxs|moe_down_combine_tab_q8_iq2_xxs|matvec_q8x_q4_k|matvec_q8x_q6_k|matvec_res_q4_k|rms_norm_q8|res_norm_q8|attn_qk_prep|attn_split_gqa4|attn_merge|swiglu_q8'}
if [ -z "$LIB" ]; then
    LIB=/tmp/nvrtc130/x/nvidia/cu13/lib
    if [ ! -e "$LIB/libnvrtc.so.13" ]; then
        python3 -m pip download -q --no-deps -d /tmp/nvrtc130 "nvidia-cuda-nvrtc==13.0.*"
        python3 -m zipfile -e /tmp/nvrtc130/nvidia_cuda_nvrtc-13.0.*.whl /tmp/nvrtc130/x
    fi
fi
BIN=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "bin"))')
CUOBJDUMP=$BIN/cuobjdump
NVDISASM=$(command -v nvdisasm || ls "$BIN/nvdisasm" /tmp/nv/nvd/nvidia/cu13/bin/nvdisasm 2>/dev/null | head -1 || true)
OUT=$(mktemp -d)
for fam in deltanet.cu moe.cu matvec.cu attention.cu norm.cu; do
    LD_LIBRARY_PATH="$LIB" REDLITE_CUBIN_OUT="$OUT/$fam.cubin" REDLITE_CUBIN_FAMILY=$fam \
        cargo test -q --release -p redlite-cuda --features cuda --test nvrtc_compile write_matvec_cubin -- --ignored \
        >"$OUT/$fam.log" 2>&1 || { echo "$fam: compile failed (see $OUT/$fam.log)"; continue; }
    if [ -n "$NVDISASM" ]; then "$NVDISASM" -c "$OUT/$fam.cubin" >"$OUT/$fam.sass" 2>/dev/null || true; fi
    "$CUOBJDUMP" -res-usage "$OUT/$fam.cubin" 2>&1 | paste - - | sed -n 's/^ *Function \([a-z0-9_]*\):.*\(REG:[0-9]*\) \(STACK:[0-9]*\).*/\1 \2 \3/p' |
        { grep -E "^($RE) " || true; } | while read -r k reg stack; do
            spills=n/a
            if [ -s "$OUT/$fam.sass" ]; then
                spills=$(awk -v k="$k" '$0 == ".text."k":" {on=1; next} /^\.text\./ {on=0} on && /SpillRefill/ {n++} END {print n+0}' "$OUT/$fam.sass")
            fi
            printf '%-40s %-8s %-10s %s spill instructions\n' "$k" "$reg" "$stack" "$spills"
        done
done | sort -u
echo "(NVRTC from $LIB; cubins in $OUT; spill instructions need nvdisasm: pip nvidia-cuda-nvdisasm)"
