source .gpu/bootstrap.sh
pip install -q --no-index --no-deps .whl/llguidance-*.whl
{ git rev-parse HEAD; git status --short; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } > $OUT/env2.txt 2>&1
timeout 240 python3 -m pytest -q tests/test_penalties.py tests/test_speculative_mtp.py -k cuda -p no:cacheprovider > $OUT/tests.txt 2>&1
tail -3 $OUT/tests.txt
python3 perf/diag_speculative.py --variant mixed@8+mtp+accept+k2 --tokens 48 --replays --out $OUT/replays_k2.json > $OUT/replays_k2.txt 2>&1
grep -A30 '"replays"' $OUT/replays_k2.txt | head -30; grep ms_per_step $OUT/replays_k2.txt; tail -3 $OUT/replays_k2.txt
