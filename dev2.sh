source .gpu/bootstrap.sh
pip install -q --no-index --no-deps .whl/llguidance-*.whl
for k in 2 1; do
python3 perf/diag_speculative.py --variant mixed@8+mtp+accept+k$k --tokens 48 --replays --out $OUT/replays_k$k.json > $OUT/replays_k$k.txt 2>&1
grep -A30 '"replays"' $OUT/replays_k$k.txt | head -30; grep ms_per_step $OUT/replays_k$k.txt
done
