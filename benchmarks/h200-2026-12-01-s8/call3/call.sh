# session 8, call 3 (one H200): decode_trace.py (is nvJPEG's idle time per call or per image; a
# chrome trace of two steps with the decode beside them)
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
G=/tmp/s8c3; rm -rf $G; mkdir -p $G; T0=$(date +%s)
python scripts/shapes_imagefolder.py /tmp/s8_sf --num-train 256 --num-val 16 --format jpg \
   --size 500x375 --noise 40 --no-cache > $G/jpgs.log 2>&1
timeout 200 python benchmarks/h200-2026-12-01-s8/call3/decode_trace.py > $G/decode_trace.log 2>&1
grep -E "ms/step|Error|error" $G/decode_trace.log | grep -v Unknown
gzip -f $G/trace_decode.json; ls -la $G
echo total $(( $(date +%s) - T0 )) s
cp $G/* $OUT/
