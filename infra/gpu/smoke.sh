#!/usr/bin/env bash
# GPU smoke check for grpoflow: rollout engines, behaviour log-probs, a few steps of the real GRPOTrainer,
# optional vLLM / LMDeploy / DeepSpeed (see infra/gpu/smoke.py for the list). About a minute on one H200
# without the optional engines.
#
# Runs from the repository root with $PYTHON (default python3): it needs torch, transformers, tokenizers and
# pyyaml. It imports trainer.bootstrap, which imports the reward library and so math-verify; a GPU image
# without it can take pure-Python wheels from .whl/ (installed into a scratch --target first), e.g. made on a
# machine with network access by
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
# (add deepspeed / vllm / lmdeploy wheels there to exercise those checks), or point SMOKE_PYTHONPATH at a
# directory that holds those packages.
#
# Usage: infra/gpu/smoke.sh [smoke.py options]   e.g. infra/gpu/smoke.sh --device cpu
# The JSON result goes to stdout and to $OUT/smoke.json when OUT is set; the exit status is non-zero when a
# check fails (124 when SMOKE_TIMEOUT_S, default 300, runs out).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
  site=$(mktemp -d /tmp/grpoflow-smoke-site.XXXXXX)
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -n "${SMOKE_PYTHONPATH:-}" ]; then
  export PYTHONPATH="$SMOKE_PYTHONPATH${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
exec timeout "${SMOKE_TIMEOUT_S:-300}" "$PYTHON" infra/gpu/smoke.py "$@"
