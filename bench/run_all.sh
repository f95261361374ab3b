#!/usr/bin/env bash
# The full benchmark run behind bench/results/, in one go: bench/run_all.sh DIR OUT
#   DIR  a directory on the drive under test (state and test files go there, and are removed)
#   OUT  a new or empty directory for the JSON, PNG and logs (the committed bench/results/ is never
#        written unless you name it)
# Needs about 8 GB of RAM and 25 GB free under DIR (the largest step, 5e8 parameters; see
# bench/README.md for each command's needs), and an hour or two; run it on a quiet machine.
set -euo pipefail
if [ $# -ne 2 ]; then
    echo "usage: $0 DIR OUT  (DIR: on the drive under test; OUT: a new or empty results directory)" >&2
    exit 2
fi
DIR=$1
OUT=$2
if [ -d "$OUT" ] && [ -n "$(ls -A "$OUT")" ]; then
    echo "$0: $OUT is not empty; give a new directory so no earlier result is overwritten" >&2
    exit 2
fi
mkdir -p "$DIR" "$OUT"
DIR=$(cd "$DIR" && pwd)
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
run() { local name=$1; shift; echo "== $name: $*" | tee "$OUT/$name.log"; "$@" 2>&1 | tee -a "$OUT/$name.log"; }

# 1. Drive and memory bandwidth, raw O_DIRECT and dd baselines, every backend.
run io python bench/io.py --dir "$DIR" --size 1GiB --rounds 3 --json "$OUT/io.json" --plot "$OUT/io.png"
# 2. All in RAM at 5e7 fp32 params vs torch.optim.AdamW(fused=True).
run step-ram-5e7 python bench/step.py --params 5e7 --steps 60 --skip disk,peer,floor,footprint \
    --json "$OUT/step-ram-5e7.json" --plot "$OUT/step-ram-5e7.png"
# 3. On disk at 2e8 fp32 params, ram_budget 1/8 of the state: floor, peer, footprint (peak RSS, page cache).
run step-disk-2e8 python bench/step.py --params 2e8 --ram-budget 1/8 --dir "$DIR" --backend direct --steps 7 \
    --json "$OUT/step-disk-2e8.json" --plot "$OUT/step-disk-2e8.png"
# 4. Linear cost: 1e8 and 5e8 alternated (the drive drifts).
i=0
for n in 1e8 5e8 1e8 5e8; do
  i=$((i + 1))
  run "step-linear-$n-$i" python bench/step.py --params $n --ram-budget 1/8 --dir "$DIR" --backend direct --steps 4 \
      --skip ram,torch,peer,footprint --json "$OUT/step-linear-$n-$i.json"
done
# 5. Page cache and RSS with direct vs mmap, state 10x the budget.
run step-pagecache-1e8 python bench/step.py --params 1e8 --ram-budget 1/10 --dir "$DIR" --backend direct,mmap --steps 4 \
    --skip ram,torch,peer --json "$OUT/step-pagecache-1e8.json"
# 6. The cost of durability: durable=False vs durable=True in the same run.
run step-durable-1e8 python bench/step.py --params 1e8 --ram-budget 1/8 --dir "$DIR" --backend direct --durable both \
    --steps 5 --skip ram,torch,peer,footprint --json "$OUT/step-durable-1e8.json"
# 7. Byte flips in every state file: all must be detected.
run flip-soak python bench/flip_soak.py --flips 1000 --json "$OUT/flip_soak.json"
# 8. Crash soak: hundreds of SIGKILLs, resumed and compared bitwise.
run crash-soak python bench/crash_soak.py --kills 300 --json "$OUT/crash-soak-phases.json"
# 9. Simulated power cuts: 2,184 images of recorded runs, every backend, resumed and compared bitwise.
run powercut-soak python bench/powercut_soak.py --images 2040 --seeds 4 --json "$OUT/powercut-soak.json"
# 10. Durability in a training loop, all state in RAM: background commits vs durable=False.
run durability-5e7 python bench/durability.py --params 5e7 --dir "$DIR" --json "$OUT/durability-5e7.json"
# 11. Streamed at 2e8, ram_budget 1/8: durable (background commits) vs not, in one run.
run step-durable-2e8 python bench/step.py --params 2e8 --ram-budget 1/8 --dir "$DIR" --backend direct --durable both \
    --steps 5 --skip ram,torch,peer,footprint --json "$OUT/step-durable-2e8.json"
# 12. The step behind the loop (attach), streamed (1/8) and all in RAM; TMPDIR puts the private state on DIR.
TMPDIR="$DIR" run overlap-stream-5e7 python bench/overlap.py --ram-budget 1/8 --json "$OUT/overlap-stream-5e7.json"
TMPDIR="$DIR" run overlap-ram-5e7 python bench/overlap.py --ram-budget none --json "$OUT/overlap-ram-5e7.json"
# 13. Streamed step per moment format at 2e8, ram_budget 1/8 of the float32 state, beside the same formats' update
#     in torch ops (@torch); fourteen runs, since the compressed steps are CPU-bound on small machines and move with the host. Then the codecs'
#     and updates' params/s beside the drive.
for k in $(seq 1 14); do
  run "formats-step-2e8-$k" python bench/formats_step.py --params 2e8 --dir "$DIR" --rounds 7 \
      --formats float32,bfloat16,int8,bfloat16@torch,int8@torch --json "$OUT/formats-step-2e8-$k.json"
done
# The same with bf16 parameters and gradients (fp32 masters in the state): the mixed-precision configuration.
for k in 1 2 3 4 5 6 7 8 9; do
  run "formats-step-2e8-bf16-params-$k" python bench/formats_step.py --params 2e8 --dir "$DIR" --rounds 7 \
      --formats float32,bfloat16,int8 --param-dtype bfloat16 --json "$OUT/formats-step-2e8-bf16-params-$k.json"
done
run codec python bench/codec.py --numel 4Mi --rounds 9 --dir "$DIR" --json "$OUT/codec.json"
run kernel-parts python bench/kernel_parts.py --numel 16Mi --rounds 7 --json "$OUT/kernel-parts.json"
# 14. Convergence of the formats beside fp32 AdamW, torchao and bitsandbytes (about 25 minutes), two more demo seeds.
run convergence python bench/convergence.py --models gpt2,demo --steps 1000 --json "$OUT/convergence-main.json"
for seed in 1 2; do
  run "convergence-seed$seed" python bench/convergence.py --models demo --batch-seed $seed --steps 1000 \
      --contenders torch-adamw-fp32,ours-bfloat16,ours-int8,bnb-adamw8bit --json "$OUT/convergence-seed$seed.json"
done
run convergence-merge python bench/convergence.py --merge "$OUT/convergence-main.json" "$OUT/convergence-seed1.json" \
    "$OUT/convergence-seed2.json" --json "$OUT/convergence.json" --plot "$OUT/convergence.png"
