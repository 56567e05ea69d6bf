#!/usr/bin/env bash
# guidellm's default streaming benchmark (chat completions, content parts, usage in every chunk
# through stream_options.continuous_usage_stats) against a running `rlt-hal serve`.
# Usage: benchmarks/guidellm.sh OUT_DIR [extra guidellm run options]
#   URL        the server, without /v1          (default http://127.0.0.1:8000)
#   MODEL      its --served-model-name          (default: the first model /v1/models lists)
#   TOKENIZER  the served checkpoint's directory (required: guidellm sizes its synthetic
#              prompts with its tokenizer, read locally)
#   PROFILE    guidellm's --profile             (default kind=sweep,sweep_size=4)
#   SECONDS_PER_BENCHMARK                       (default 30)
#   DATA       guidellm's --data                (default prompt_tokens=256,output_tokens=128)
# Needs the clients extra (make test-clients builds .venv-clients); offline: no hub is asked.
set -euo pipefail
out=${1:?usage: $0 OUT_DIR [guidellm run options]}
shift
mkdir -p "$out"
GUIDELLM=${GUIDELLM:-.venv-clients/bin/guidellm}
URL=${URL:-http://127.0.0.1:8000}
MODEL=${MODEL:-$(curl -sf "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the served checkpoint directory}
PROFILE=${PROFILE:-kind=sweep,sweep_size=4}
SECONDS_PER_BENCHMARK=${SECONDS_PER_BENCHMARK:-30}
DATA=${DATA:-prompt_tokens=256,output_tokens=128}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
"$GUIDELLM" run \
    --backend "kind=openai_http,target=$URL,model=$MODEL" \
    --tokenizer "kind=huggingface_auto,model=$TOKENIZER" \
    --profile "$PROFILE" \
    --constraint "kind=max_duration,seconds=$SECONDS_PER_BENCHMARK" \
    --data "kind=synthetic_text,$DATA" \
    --output "kind=json,path=$out/guidellm.json" \
    --output "kind=console" \
    --disable-progress "$@"
