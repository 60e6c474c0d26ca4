#!/usr/bin/env bash
# gpu_check.sh (`make gpu-check`): does ampflow work on this GPU node, and how fast?
#
# Run it from the checkout's root on the GPU node (in the job that has the GPU), under
# 20 minutes (or in parts: GPU_CHECK_ONLY). One line per check:  CHECK <name> <PASS|FAIL|TIMEOUT|INFO> <figure>
# Every check has a time limit (`timeout`); the full output of each goes to
# $GPU_CHECK_OUT/<name>.log (default /tmp/ampflow-gpu-check). GPU_CHECK_ONLY="NAME ..."
# runs only the checks named (the whole script's limits add up to about 20 minutes, so a
# job with less time runs it in parts).
#
#   env      torch, CUDA, the GPUs ampflow sees (ampflow.devices.probe_devices)
#   mem      memory model vs the CUDA caching allocator (bench_memory_model --device cuda)
#   mem-graphed  the same for the step captured in a CUDA graph (--step graphed)
#   attn     the attention kernel on the GPU, fp32 and (where supported) bf16
#            (bench_attention --device cuda)
#   train    training steps/s against the GPU's measured matmul rate (bench_train --device cuda)
#   train-hires  the HiRES-size case through the trainer: steps/s eager vs compiled vs graphed
#            (and graphed with Hi-C thinning, drawn on the device),
#            launches per step, floor ratios, the GPU's kernel time per step against the wall
#            time (the kernels' names in its log), and time to early stopping with the part
#            spent outside the steps (bench_train --hires)
#   extract  extraction's packed (varlen) vs padded vs masked rows vs one at a time, ESM-2
#            650M and 3B, ESM C 600M, DNABERT-S: share of the bf16 floor, the profile's
#            components, cosine to one at a time (bench_extract --quick-gpu)
#   pytest   pytest -m "gpu and not slow" (tests/test_gpu_train.py: the Trainer, collectives, numerics;
#            test_attention.py: the kernel in fp32/bf16; test_extract_pack.py: packed rows;
#            test_extract_varlen.py: packed without mask against one at a time)
#
# Without a CUDA GPU visible to torch it prints one line, `gpu-check: SKIP ...`, and
# exits 0 (GPU_CHECK_SKIP_CODE=77 makes it exit 77, the automake/ctest "skipped" code,
# for a caller that must tell a skip from a pass). Otherwise it exits 1 if any check
# failed or timed out, else 0.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
OUT=${GPU_CHECK_OUT:-/tmp/ampflow-gpu-check}
SKIP_CODE=${GPU_CHECK_SKIP_CODE:-0}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

probe=$("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())' 2>&1)
if [ $? -ne 0 ]; then
    echo "gpu-check: FAIL torch does not import with $PY: ${probe##*$'\n'}"
    exit 1
fi
read -r TORCH_V CUDA_V HAVE_GPU <<<"$probe"
if [ "$HAVE_GPU" != "True" ]; then
    echo "gpu-check: SKIP no CUDA GPU visible to torch $TORCH_V (CUDA build: $CUDA_V; CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset})"
    exit "$SKIP_CODE"
fi

mkdir -p "$OUT"
failed=0

# check NAME SECONDS FIGURE-COMMAND -- COMMAND...: runs COMMAND under `timeout`, logs to
# $OUT/NAME.log, prints one line with the figure FIGURE-COMMAND extracts from the log.
check() {
    local name=$1 limit=$2 figure=$3
    shift 4
    if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ " $GPU_CHECK_ONLY " != *" $name "* ]]; then
        return 0  # not asked for: no line
    fi
    local log="$OUT/$name.log" t0=$SECONDS rc status fig
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status=TIMEOUT
    elif [ $rc -eq 0 ]; then status=PASS
    else status=FAIL
    fi
    fig=$(bash -c "$figure" <"$log" 2>/dev/null | tr -s ' \n' ' ' | cut -c1-"${FIGURE_WIDTH:-600}")
    [ "$status" = PASS ] || failed=1
    echo "CHECK $name $status ${fig:-"(no figure; see $log)"} [$((SECONDS - t0)) s of $limit s, rc $rc]"
}

check env 20 'cat' -- "$PY" - <<'PYEOF'
import torch
from ampflow.amp.memory.cuda import cuda_overheads
from ampflow.devices import probe_devices

info = probe_devices()
gpus = "; ".join(f"{d.get('name')} {d.get('memory_total', 0) / 2**30:.0f} GiB" for d in info["devices"])
cap = torch.cuda.get_device_capability(0)
o = cuda_overheads()
print(f"torch {torch.__version__} CUDA {torch.version.cuda} cuDNN {torch.backends.cudnn.version()}; "
      f"torch sees {torch.cuda.device_count()} GPU(s) ({torch.cuda.get_device_name(0)}, sm{cap[0]}{cap[1]}); "
      f"ampflow sees {len(info['devices'])}: {gpus or 'none (NVML: ' + str(info.get('nvml')) + ')'}; "
      f"bf16 {torch.cuda.is_bf16_supported()}; expected cuBLAS(Lt) workspaces {o.workspace_bytes / 2**20:.0f} MiB")
PYEOF

# mm10's chromosome sizes (UCSC), so the benchmarks build mm10's real shapes on any node
mkdir -p "$OUT/annotation"
printf 'chr%s\t%s\n' 1 195471971 2 182113224 3 160039680 4 156508116 5 151834684 6 149736546 7 145441459 \
    8 129401213 9 124595110 10 130694993 11 122082543 12 120129022 13 120421639 14 124902244 15 104043685 \
    16 98207768 17 94987271 18 90702639 19 61431566 X 171031299 Y 91744698 >"$OUT/annotation/mm10.chrom.sizes"

# predicted vs allocated (net of the persistent cuBLAS workspaces), requested and reserved
check mem 120 'grep -E "^worst ratio" | head -1' -- \
    "$PY" scripts/bench_memory_model.py --device cuda --sweep "" --check --data-dir "$OUT"

# the same for the step captured in a CUDA graph (the capture's peak: a replay allocates nothing)
check mem-graphed 120 'grep -E "^worst ratio" | head -1' -- \
    "$PY" scripts/bench_memory_model.py --device cuda --step graphed --dtypes fp32 --sweep "" --check --data-dir "$OUT"

# the blocked kernel against the per-offset baseline and full masked attention at mm10
# 1 Mb and 100 kb (full attention at 100 kb needs ~47 GiB in fp32)
check attn-fp32 50 'grep -E "^summary"' -- \
    "$PY" scripts/bench_attention.py --device cuda --dtype float32 --sizes 2737 27268 --chunks 2048 --max-full-gib 60
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_bf16_supported() else 1)' 2>/dev/null; then
    check attn-bf16 50 'grep -E "^summary"' -- \
        "$PY" scripts/bench_attention.py --device cuda --dtype bfloat16 --sizes 2737 27268 --chunks 2048 --max-full-gib 60
else
    echo "CHECK attn-bf16 INFO this GPU has no bf16"
fi

# steps/s at the three mm10 shapes against the GPU's measured matmul rate
check train 150 'grep -E "^  new: step|matrix-product rate" | sed -E "s/; its components.*(;[^;]*steps\/s)/\1/"' -- \
    "$PY" scripts/bench_train.py --device cuda --chrom-sizes "$OUT/annotation/mm10.chrom.sizes" \
    --shapes 1000000:10 500000:20 100000:30 --batch 32 --cells 128 --steps 3 --shape-seconds 30 --matmul 4096 --threads 4

# the HiRES-size case through the trainer (7,469 synthetic cells, batch 32, fp32) at the three
# mm10 shapes: steps/s eager (today's step), graphed with the strata one at a time and
# stacked (the default), compiled + graphed at 1 Mb/10 only (its compile takes a minute or
# more), launches and GPU kernels per step, the FLOP and bytes floor ratios;
# then 1 Mb/10 trained to early stopping under the template's settings, at most 20 s here
# (the full log says the host syncs per step, compile and capture seconds, seconds per epoch)
FIGURE_WIDTH=3600 check train-hires 300 'grep -E "^hires [0-9]+:[0-9]+ [a-z+-]+: |^hires early-stopping|FAILED" | grep -v "by op" | sed -E "s/^hires //; s/ \(eager [0-9.]+: ([0-9.]+x)\)/ \1/; s/ \(graph launches [0-9]+\)//; s/GPU kernels\+copies\/step/kernels/; s/ \(\+[0-9.]+ in optimizer.step; CUDA sync debug mode ([0-9.]+)\)/ (sync debug mode \1)/; s/ \(\+[0-9.]+ in optimizer[^)]*\)//; s/, first step [0-9.]+ s//; s/ \([0-9]+ steps\), FLOP floor ratio/, FLOP floor/; s/bytes floor ratio/bytes floor/; s/ \(parameters[^)]*\)//; s/ GPU kernel and copy time ([0-9.]+) ms\/step against ([0-9.]+) ms\/step of wall time;.*$/ kernels busy \1 of \2 ms\/step/; s/ \(validation each epoch included\);/;/; s/$/;/"' -- \
    "$PY" scripts/bench_train.py --hires --device cuda --chrom-sizes "$OUT/annotation/mm10.chrom.sizes" \
    --shapes 1000000:10 500000:20 100000:30 --batch 32 --hires-cells 7469 --contacts 20000 \
    --modes eager graphed-loop graphed graphed-thinned compiled+graphed --compiled-shapes 1000000:10 --hires-steps 20 --matmul 4096 \
    --hires-early-stopping --early-stopping-seconds 20

# the packed extraction path against the padded one and the floor (one line per figure in the log)
check extract 200 'grep -E "^target|cosine varlen"' -- \
    "$PY" scripts/bench_extract.py --quick-gpu

# the GPU tests but the slow ones (the compiled steps' inductor compiles): `pytest -m gpu`
# runs them all, on its own (several minutes)
check pytest 200 'tail -n 1' -- \
    "$PY" -m pytest -m "gpu and not slow" -q -p no:cacheprovider ${GPU_CHECK_TESTS:-tests/test_gpu_train.py tests/test_static_step.py tests/test_attention.py tests/test_extract_pack.py tests/test_extract_varlen.py}

echo "gpu-check: $([ $failed -eq 0 ] && echo PASS || echo FAIL) (logs in $OUT)"
exit $failed
