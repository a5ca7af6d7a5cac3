#!/usr/bin/env bash
# The one script to run when a GPU machine is lent: rollout engines and their behaviour log-probs, then the real
# trainer through `grpoflow train` in the layouts the GPU recipes use (one GPU with the engine colocated,
# synchronous; 2 trainer ranks + 1 rollout GPU, asynchronous, on 3+ GPUs), a few steps each, with step times and
# the engine-vs-trainer log-prob difference printed; optional vLLM / LMDeploy / DeepSpeed checks. See
# infra/gpu/smoke.py for the list. Under 8 minutes in all (SMOKE_TIMEOUT_S, default 480; each layout 150 s).
#
# Runs from the repository root with $PYTHON (default python3): it needs torch, transformers, tokenizers and
# pyyaml. It imports trainer.bootstrap, which imports the reward library and so math-verify; a GPU image
# without it can take pure-Python wheels from .whl/ (installed into a scratch --target first, and seen by the
# `grpoflow train` subprocesses through PYTHONPATH), e.g. made on a machine with network access by
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
# or point SMOKE_PYTHONPATH at a directory that holds those packages. vLLM / LMDeploy / DeepSpeed checks run
# when those import: their wheels must match the image's torch exactly (vLLM pins it) and are far larger than
# a lent machine's 64 MiB working tree, so there they are skipped and the layouts use the transformers engine.
# LMDeploy has no CPU backend; `--device cpu` runs everything else small (2 gloo trainer ranks for the async
# layout), a few minutes on two cores.
#
# Usage: infra/gpu/smoke.sh [smoke.py options]   e.g. infra/gpu/smoke.sh --device cpu
# The JSON result goes to stdout and to $OUT/smoke.json when OUT is set; the exit status is non-zero when a
# check fails (124 when SMOKE_TIMEOUT_S runs out).
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
exec timeout "${SMOKE_TIMEOUT_S:-480}" "$PYTHON" infra/gpu/smoke.py "$@"
