#!/usr/bin/env bash
# One lent-GPU session's device check, split over processes so that fla's first compiles
# (CPU-bound, one configuration after another) do not starve the rest. Writes its logs to $OUT.
#
#   bash benchmarks/device_run.sh [seconds]      # default 420: every check is stopped by then, and
#                                                # the cost-model calibration 90 s later
#
# Needs the image the device tool lends (torch, Triton, msgpack, networkx, hypothesis) and the
# wheels in the ignored .whl/ (fla-core, flash-linear-attention, transformers, regex, zstandard,
# orjson); carry .whl with the working tree. The processes share one GPU, so their timings
# disturb each other: read them as rough.
set -uo pipefail
limit=${1:-420}
out=${OUT:-/tmp/harts-device-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$out/pip.log" 2>&1 || { tail -20 "$out/pip.log"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/hp . \
    >> "$out/pip.log" 2>&1 || { tail -20 "$out/pip.log"; exit 4; }
export PYTHONPATH=/tmp/hp:/tmp/site PATH=/tmp/hp/bin:/tmp/site/bin:$PATH
python3 -c "import harts.executor.runtime, fla.ops.kda, transformers; print('imports ok')" 2>&1 | tail -3

check() {  # log-name, then device_check arguments
    local name=$1
    shift
    timeout "$limit" python3 benchmarks/device_check.py "$@" > "$out/$name.log" 2>&1
    echo "$name exited $?" >> "$out/$name.log"
}
# fla against our ops, one configuration per kernel (fla's first compiles are minutes otherwise,
# docs/gpu-runs.md). With TF32 in Triton's float32 dots (its default here), as a user runs it:
check fla-channel --fla-autotune-configs 1 --gates channel --sections ops,op-timing,update \
    --workloads treestep --repeat 3 &
# In true float32 (fla's float32 rows should then match our op to ~1e-6), and the whole model
# with fla against HF per trajectory. The scalar gate's fla rows fail on Hopper with Triton < 3.7.1.
TRITON_F32_DEFAULT=ieee check fla-ieee --fla-autotune-configs 1 --sections ops,fidelity &
# Everything that needs no fla (sections run in the script's order, whatever the order here).
check nccl --no-fla --sections nccl &
check main --no-fla --sections syncs,update --repeat 3 --budget-s $((limit - 120))
wait
# L2's cost model on this GPU (our torch linear attention: fla's first compiles would be timed otherwise).
harts init-model --preset tiny --vocab-size 32000 -o /tmp/calibrate-model > /dev/null 2>&1
HARTS_LINEAR_ATTENTION=torch timeout 90 harts calibrate --model /tmp/calibrate-model --device cuda \
    --rows 65536 --lengths 512,2048,8192,32768 > "$out/calibrate.log" 2>&1
echo "calibrate exited $?" >> "$out/calibrate.log"
tail -n 80 "$out"/main.log "$out"/nccl.log "$out"/fla-channel.log "$out"/fla-ieee.log "$out"/calibrate.log
