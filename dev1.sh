source .gpu/bootstrap.sh
pip install -q --no-index --no-deps .whl/llguidance-*.whl
{ git rev-parse HEAD; git status --short; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } > $OUT/env.txt 2>&1
timeout 60 python3 perf/kernels/diag_graph_launch.py --out $OUT/graph_launch.json 2>&1 | tail -8
timeout 60 python3 -m pytest -q tests/test_gpu_engine.py -k chain -p no:cacheprovider 2>&1 | tail -2
cd perf
timeout 200 python3 bench_decode.py --out $OUT/cuts_pfg.json --tokens 96 --no-eager --variants mixed,mixed+cuts,mixed@8,mixed@8+cuts,mixed@8+pfg,mixed@8+pfg2,mixed > $OUT/cuts_pfg.txt 2>&1
grep -o '"variant": "[^"]*"\|"tok_per_s": [0-9.]*\|"graph_ms": [0-9.]*' $OUT/cuts_pfg.json | paste -sd' ' | sed 's/"variant"/\n"variant"/g'
tail -2 $OUT/cuts_pfg.txt
cd ..
for v in mixed@8+mtp+accept+k2 mixed@8+mtp+accept+k2+cuts; do
timeout 110 python3 perf/diag_speculative.py --variant $v --tokens 48 --replays --out $OUT/replays_$(echo $v | tr '@+' '__').json > $OUT/replays_$(echo $v | tr '@+' '__').txt 2>&1
grep -A40 '"replays"' $OUT/replays_$(echo $v | tr '@+' '__').txt | tr -d ' \n'; echo; grep '"ms_per_step\|graph_ms' $OUT/replays_$(echo $v | tr '@+' '__').txt
done
timeout 50 python3 perf/kernels/diag_gemv_i8.py --out $OUT/gemv_i8_h200.json --bits 4,2 \
  --shapes 17408:5120 --configs "2,16,168,1,0;2,24,168,1,0;4,0,168,1,0,10" > $OUT/gemv.txt 2>&1
grep " us " $OUT/gemv.txt
