#!/bin/sh
# Regenerates tests/fixtures/v41/{a,b,b_faithful,dspark} (the V4.1 parity fixtures of tests/test_v41_*.py) with
# DeepSeek's reference inference/model.py + engram.py at Hugging Face revision dba1be0a40aa45a94ad051997016db3960a90277,
# placed (git-ignored) under tools/v41_reference/upstream/inference/ and checked against SOURCES.md.
#
# --fix-index-k-quirk: deepinfer follows the fixed index-key behaviour (every ratio-2 index source scores against
# its own index keys on every decode step; NOTES.md section 5), so the fixtures are made with the fix.
# fp32 mode: fp32 arithmetic on bf16-grid weights (the checkpoint stores them as bf16, losslessly); the KV, latent
# and index caches are still rounded through FP8/FP4 as the reference does.
set -e
here=$(cd "$(dirname "$0")" && pwd)
out="${1:-$here/../../tests/fixtures/v41}"
cd "$here"
python3 run_tiny.py --config a --prefill 40 --decode 16 --fix-index-k-quirk --save "$out/a"
python3 run_tiny.py --config b --prefill 27 --decode 17 --fix-index-k-quirk --save "$out/b"
# config b in the checkpoint's dtypes (FP8 32x32 ue8m0 dense, FP4 experts, bf16 activations), plus the same
# reference in fp32 mode on the dequantized weights fed the same tokens ("logits_fp32")
python3 run_tiny.py --config b --prefill 27 --decode 17 --fix-index-k-quirk --mode faithful --save "$out/b_faithful"
# config b plus two DSpark draft blocks (run_tiny.py DSPARK): Transformer.forward_spec after the prefill (seeds the
# draft windows) and after each of 8 greedy decode steps; dspark.pt holds the drafts (README.md)
python3 run_tiny.py --config b --prefill 40 --decode 8 --fix-index-k-quirk --dspark --save "$out/dspark"
