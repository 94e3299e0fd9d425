export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
for s in 1 2; do
  timeout 250 python3 bench/triton_h200.py --no-fla --no-check --shapes 0,2 --variants 15,11 --seed $s --json $OUT/v_seed$s.json 2>&1 | tee -a $OUT/log
done
