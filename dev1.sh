source .gpu/bootstrap.sh
pip install -q --no-index --no-deps .whl/llguidance-*.whl
{ git rev-parse HEAD; git status --short; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } > $OUT/env.txt 2>&1
timeout 60 python3 perf/kernels/diag_graph_launch.py --out $OUT/graph_launch.json 2>&1 | tail -8
timeout 170 python3 perf/diag_speculative.py --variant mixed@8+mtp+accept+k2 --tokens 48 --replays --out $OUT/replays_k2.json > $OUT/replays_k2.txt 2>&1
grep -A24 '"replays"' $OUT/replays_k2.txt | tr -d ' \n'; echo; grep ms_per_step $OUT/replays_k2.txt; tail -2 $OUT/replays_k2.txt
cd perf
timeout 170 python3 bench_decode.py --out $OUT/pfg.json --tokens 96 --no-eager --variants mixed@8,mixed@8+pfg,mixed@8+pfg2,mixed@8 > $OUT/pfg.txt 2>&1
grep -o '"variant": "[^"]*"\|"tok_per_s": [0-9.]*\|"graph_ms": [0-9.]*' $OUT/pfg.json | paste -sd' ' | sed 's/"variant"/\n"variant"/g'
cd ..
timeout 80 python3 perf/kernels/diag_gemv_i8.py --out $OUT/gemv_i8_h200.json \
  --shapes 17408:5120 --configs "2,16,168,1,0;2,24,168,1,0;4,0,168,1,0,10;4,16,168,1,0;2,0,168,1,0,10" \
  > $OUT/gemv.txt 2>&1
grep " us " $OUT/gemv.txt
