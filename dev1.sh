source .gpu/bootstrap.sh
pip install -q --no-index --no-deps .whl/llguidance-*.whl
{ git rev-parse HEAD; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } > $OUT/env.txt 2>&1
python3 perf/kernels/diag_gemv_i8.py --out $OUT/gemv_i8_h200.json \
  --shapes 17408:5120,5120:5120,5120:17408,34816:5120,262144:5120 \
  --configs "2,16,168,1,0;2,24,168,1,0;4,0,168,1,0,10;4,0,168,1,0,5;4,16,168,1,0;2,0,168,1,0,10;1,0,168,1,0,3;2,16,0,1,0;2,32,168,1,0;4,0,0,1,0,10" \
  > $OUT/gemv.txt 2>&1
tail -3 $OUT/gemv.txt
timeout 300 python3 -m pytest -q tests/test_penalties.py tests/test_speculative_mtp.py -k cuda -p no:cacheprovider > $OUT/tests.txt 2>&1
tail -3 $OUT/tests.txt
