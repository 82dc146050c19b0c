#!/usr/bin/env bash
# One prepared GPU check of prunetool in half precision: score -> prune (default guided criterion, with
# verification in the same dtype and device) -> heads -> a small eval of the current run.
#
# Run from the repository root with the package installed (`prunetool` on PATH, or PRUNETOOL="python -m
# prunetool"). The model must already be readable there (a folder, or a demo alias already in the
# prunetool cache): a machine without network cannot fetch it.
#
#   bench/gpu_check.sh                                   # bfloat16 on cuda, smollm2-135m, under 8 minutes
#   DEVICE=cpu DTYPE=float32 SEQ_LEN=64 CALIB=wikitext.raw bench/gpu_check.sh  # a rehearsal on the CPU
#
# Every setting is an environment variable (defaults in brackets): OUT [a new temp folder], MODEL
# [smollm2-135m], DTYPE [bfloat16], DEVICE [cuda], SAMPLES [8], DROP [6], HEAD_SAMPLES [2], LIMIT [10],
# SEQ_LEN [the tool's default], CALIB [the model's own generated text], BUDGET [480 seconds for all steps together; each step gets what is left],
# RESULTS [unset; a NAME writes the summary to bench/results/NAME.json for docs/pruning.md], REPAIR [unset; N adds
# --patch to prune and a heal of N tokens after it: the repair path on the device], SCALE [unset; 1 adds the same
# prune with --low-memory (the layer-streamed executor: same layers? byte-identical tensors?) and a score with
# --device-map auto (largest difference from the plain score)], SUBLAYER [unset; 1 adds prune --unit attention
# --drop $DROP and serves the written nemotron-nas folder with vLLM against transformers (bench/vllm_serve_check.py:
# greedy tokens and log-probabilities; needs vllm installed)], HEAL_LAUNCH [unset; ddp, fsdp2 or zero3 heals the
# pruned model HEAL_TOKENS (16384) tokens twice with the same global batch, once in one process and once under
# accelerate launch --config_file configs/accelerate/$HEAL_LAUNCH.yaml --num_processes $HEAL_RANKS (default: every
# GPU; 1 GPU still wraps the model for FSDP2/ZeRO-3): final losses and held-out perplexity side by side].
# Each step's stdout goes to $OUT/<step>.out and its stderr to $OUT/<step>.log; a failing step is named
# on stderr (gpu_check: FAILED at step '...') after the end of its output, and the script exits 1.
set -euo pipefail

OUT=${OUT:-$(mktemp -d)}
MODEL=${MODEL:-smollm2-135m}
DTYPE=${DTYPE:-bfloat16}
DEVICE=${DEVICE:-cuda}
SAMPLES=${SAMPLES:-8}
DROP=${DROP:-6}
HEAD_SAMPLES=${HEAD_SAMPLES:-2}
LIMIT=${LIMIT:-10}
SEQ_LEN=${SEQ_LEN:-}
CALIB=${CALIB:-}
BUDGET=${BUDGET:-480}
read -r -a PRUNETOOL <<<"${PRUNETOOL:-prunetool}"
PYTHON=${PYTHON:-python}

mkdir -p "$OUT"
SEQ=()
HEAD_SEQ=()
if [[ -n "$SEQ_LEN" ]]; then
    SEQ=(--seq-len "$SEQ_LEN")
    HEAD_SEQ=(--seq-len "$SEQ_LEN")
fi
if [[ -n "$CALIB" ]]; then  # prune and eval take the scores' calibration from the current run
    SEQ+=(--calib "$CALIB")
    HEAD_SEQ+=(--calib "$CALIB")
fi
COMMON=(--dtype "$DTYPE" --device "$DEVICE")
START=$SECONDS
TIMES=()

# step NAME COMMAND...: run with what is left of BUDGET, log to $OUT/NAME.log, time it, name it on failure.
step() {
    local name=$1
    shift
    local left=$((BUDGET - (SECONDS - START)))
    if ((left <= 0)); then
        echo "gpu_check: FAILED at step '$name': the ${BUDGET}s budget is spent before it could start" >&2
        exit 1
    fi
    echo "== $name (at most ${left}s): ${*}"
    local began=$SECONDS rc=0
    timeout --kill-after=10 "$left" "$@" >"$OUT/$name.out" 2>"$OUT/$name.log" || rc=$?
    local took=$((SECONDS - began))
    if ((rc != 0)); then
        tail -n 5 "$OUT/$name.out" >&2 || true
        tail -n 20 "$OUT/$name.log" >&2 || true
        if ((rc == 124 || rc == 137)); then
            echo "gpu_check: FAILED at step '$name': timed out after ${took}s (budget ${BUDGET}s; log $OUT/$name.log)" >&2
        else
            echo "gpu_check: FAILED at step '$name' (exit $rc after ${took}s; log $OUT/$name.log)" >&2
        fi
        exit 1
    fi
    TIMES+=("$name ${took}s")
    echo "   $name ok in ${took}s"
}

step score "${PRUNETOOL[@]}" score "$MODEL" "${COMMON[@]}" --samples "$SAMPLES" "${SEQ[@]}" \
    --output-file "$OUT/scores.json"
# MODEL omitted: the current run (the scores just computed) is the starting point.
PATCH=()
[[ -n "${REPAIR:-}" ]] && PATCH=(--patch --patch-windows 16)
step prune "${PRUNETOOL[@]}" prune --drop "$DROP" "${COMMON[@]}" "${PATCH[@]}" --output-dir "$OUT/pruned" --force --json
if [[ -n "${REPAIR:-}" ]]; then  # the repair on the device: the patch above, then a short heal of it
    step heal "${PRUNETOOL[@]}" heal --tokens "$REPAIR" --seq-len 256 --batch-size 4 "${COMMON[@]}" \
        --output-dir "$OUT/healed" --force --json
fi
step heads "${PRUNETOOL[@]}" heads "$MODEL" "${COMMON[@]}" --samples "$HEAD_SAMPLES" "${HEAD_SEQ[@]}" \
    --output-dir "$OUT/heads" --force
step eval "${PRUNETOOL[@]}" eval --tasks heldout_ppl,hop_name --limit "$LIMIT" "${COMMON[@]}" \
    --output-file "$OUT/eval.json"
if [[ -n "${SCALE:-}" ]]; then  # after eval: these record runs of their own
    step prune_streamed "${PRUNETOOL[@]}" prune "$MODEL" --drop "$DROP" "${COMMON[@]}" "${PATCH[@]}" "${SEQ[@]}" \
        --samples "$SAMPLES" --low-memory --output-dir "$OUT/pruned-streamed" --force --json
    step score_device_map "${PRUNETOOL[@]}" score "$MODEL" "${COMMON[@]}" --samples "$SAMPLES" "${SEQ[@]}" \
        --device-map auto --output-file "$OUT/scores-device-map.json"
fi
if [[ -n "${SUBLAYER:-}" ]]; then  # an attention-pruned folder served by vLLM's nemotron_nas model
    step prune_attention "${PRUNETOOL[@]}" prune "$MODEL" --unit attention --drop "$DROP" "${COMMON[@]}" "${SEQ[@]}" \
        --samples "$SAMPLES" --output-dir "$OUT/pruned-attention" --force --json
    step vllm_serve "$PYTHON" bench/vllm_serve_check.py "$OUT/pruned-attention" --dtype "$DTYPE"
fi
if [[ -n "${HEAL_LAUNCH:-}" ]]; then  # heal under accelerate launch against one process, same global batch
    HEAL_RANKS=${HEAL_RANKS:-$("$PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
    HEAL_ARGS=(heal "$OUT/pruned" --tokens "${HEAL_TOKENS:-16384}" --seq-len 256 --batch-size 2
               --grad-accum $((2 * HEAL_RANKS)) --train all --dtype "$DTYPE" --force --json)
    step heal_one_process "${PRUNETOOL[@]}" "${HEAL_ARGS[@]}" --device "$DEVICE" --output-dir "$OUT/healed-one"
    step heal_launched "$PYTHON" -m accelerate.commands.launch --config_file "configs/accelerate/$HEAL_LAUNCH.yaml" \
        --num_processes "$HEAL_RANKS" -m prunetool "${HEAL_ARGS[@]}" --output-dir "$OUT/healed-launched"
fi

# What the run is for: the checks held in $DTYPE on $DEVICE, and by how much.
NUMBERS=$("$PYTHON" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
record = json.loads((out / "pruned" / "prune.json").read_text())
report = json.loads((out / "prune.out").read_text())  # --json: the report is stdout
ppl, check = report["perplexity"], report["verification"]
gap = abs(check["perplexity"] - ppl["after"]) / ppl["after"]
cache = (f"cache logprob gap {check['cached_logprob_gap']:.4f} (atol {check['cache_logprob_atol']})"
         if "cached_logprob_gap" in check else f"cached greedy identical: {check['cached_generation_matches']}")
models = json.loads((out / "eval.json").read_text())["models"]
held = {label: entry["heldout_ppl"]["perplexity"] for label, entry in models.items() if "heldout_ppl" in entry}
scale = ""
if (out / "prune_streamed.out").exists():
    import hashlib

    streamed = json.loads((out / "prune_streamed.out").read_text())
    digest = lambda folder: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.safetensors"))}
    plain_scores = json.loads((out / "scores.json").read_text())["layers"]
    mapped_scores = json.loads((out / "scores-device-map.json").read_text())["layers"]
    largest = max(abs(a[k] - b[k]) for a, b in zip(plain_scores, mapped_scores) for k in a
                  if isinstance(a[k], float) and isinstance(b[k], float))
    scale = (f"; --low-memory prune removed {streamed['plan']['removed']}, tensors identical to the in-memory prune: "
             f"{digest(out / 'pruned') == digest(out / 'pruned-streamed')}, peak RSS {streamed['peak_rss_bytes'] / 2**30:.2f} GiB; "
             f"--device-map auto scores differ by at most {largest:.2e}")
if (out / "vllm_serve.out").exists():
    served = json.loads((out / "vllm_serve.out").read_text().strip().splitlines()[-1])
    scale += (f"; vLLM served the attention-pruned folder ({served['attention_no_op_layers']} no-op attention layers): "
              f"greedy tokens agree on {100 * served['mean_agreeing_fraction']:.0f}% of positions before any difference, "
              f"log-probability gap at most {served['max_logprob_gap']:.3f}")
if (out / "heal_launched.out").exists():
    last = lambda name: json.loads([l for l in (out / name).read_text().splitlines() if l.startswith("{")][-1])["heal"]
    one, launched = last("heal_one_process.out"), last("heal_launched.out")
    scale += (f"; heal all under {launched['world_size']} launched rank(s): final loss {launched['loss_summary']['last']:.5f} vs "
              f"{one['loss_summary']['last']:.5f} in one process, held-out ppl {launched['perplexity']['after']:.3f} vs "
              f"{one['perplexity']['after']:.3f}")
print(f"removed {record['removed']}; held-out ppl {ppl['before']:.3f} -> {ppl['after']:.3f}; reloaded "
      f"{check['perplexity']:.3f} (relative gap {gap:.2e}, rtol {check['perplexity_rtol']}); {cache}; "
      f"eval heldout_ppl {', '.join(f'{k} {v:.3f}' for k, v in held.items())}{scale}")
EOF
) || { echo "gpu_check: FAILED at step 'summary': could not read the reports in $OUT" >&2; exit 1; }

SUMMARY="gpu_check: OK, $DTYPE on $DEVICE, $MODEL, $((SECONDS - START))s of ${BUDGET}s (${TIMES[*]}); $NUMBERS"
echo "$SUMMARY; outputs in $OUT"
if [[ -n "${RESULTS:-}" ]]; then  # RESULTS=NAME: the summary as bench/results/NAME.json, for the docs
    "$PYTHON" - "$RESULTS" "$SUMMARY" "$DEVICE" "$DTYPE" "$MODEL" <<'EOF'
import sys
from pathlib import Path

sys.path.insert(0, str(Path("bench").resolve()))
import torch
from provenance import write_results

name, summary, device, dtype, model = sys.argv[1:6]
sys.argv = [str(Path("bench/gpu_check.sh").resolve())]  # provenance names the script, not this snippet
hardware = torch.cuda.get_device_name(0) if device.startswith("cuda") and torch.cuda.is_available() else "cpu"
write_results(name, {"summary": summary, "device": device, "hardware": hardware, "dtype": dtype, "model": model})
EOF
fi
