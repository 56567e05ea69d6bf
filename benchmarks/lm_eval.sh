#!/usr/bin/env bash
# lm-evaluation-harness's local-completions against a running `rlt-hal serve`: the tokenizer is
# the server's (lm-eval finds /tokenizer_info and /tokenize and uses them), prompts go as
# batched token-id lists (--batch_size); generate_until tasks score through /v1/completions, and
# loglikelihood (multiple-choice) tasks through its echo and logprobs (max_tokens 1, the prompt's
# tokens scored: what lm-eval sends).
# Usage: benchmarks/lm_eval.sh OUT_DIR TASKS [extra lm_eval options]
#   TASKS        lm-eval task names; with INCLUDE_PATH, tasks of your own (YAML + local data:
#                no dataset hub is reached from here)
#   URL          the server, without /v1   (default http://127.0.0.1:8000)
#   MODEL        its --served-model-name   (default: the first model /v1/models lists)
#   BATCH_SIZE   prompts per request       (default 2)
#   INCLUDE_PATH a folder of task YAMLs    (optional)
# Needs the clients extra (make test-clients builds .venv-clients).
set -euo pipefail
out=${1:?usage: $0 OUT_DIR TASKS [lm_eval options]}
tasks=${2:?usage: $0 OUT_DIR TASKS [lm_eval options]}
shift 2
mkdir -p "$out"
LM_EVAL=${LM_EVAL:-.venv-clients/bin/lm_eval}
URL=${URL:-http://127.0.0.1:8000}
MODEL=${MODEL:-$(curl -sf "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')}
BATCH_SIZE=${BATCH_SIZE:-2}
include=()
test -z "${INCLUDE_PATH:-}" || include=(--include_path "$INCLUDE_PATH")
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
"$LM_EVAL" --model local-completions \
    --model_args "model=$MODEL,base_url=$URL/v1/completions,max_retries=1" \
    --tasks "$tasks" "${include[@]}" \
    --batch_size "$BATCH_SIZE" \
    --output_path "$out" --log_samples "$@"
