#!/usr/bin/env bash
# The one script to run when a GPU machine is lent: what a GPU changes, checked with the real trainer on small
# and real-size random models (no download). In order: the transformers engine's behaviour log-probs against
# the trainer's forward; `grpoflow train` in the layouts the GPU recipes use (one GPU with the engine
# colocated, synchronous; 2 trainer ranks + 1 rollout GPU, asynchronous, on 3+ GPUs); the colocated
# transformers engine's log-probs against the trainer's in bf16 (sampling/sampling_logp_difference/mean of
# real steps, bounded); bf16 training with fp32 master weights against an fp32 reference (one update at lr
# 1e-6 from the same weights and batch); the memory plan against torch.cuda.max_memory_allocated for random
# Qwen2.5-0.5B / 1.5B-shaped models (within 15 %); DeepSpeed ZeRO-2 with one rank through `grpoflow train`;
# optional vLLM / LMDeploy checks. See infra/gpu/smoke.py for each. Under 8 minutes in all (SMOKE_TIMEOUT_S,
# default 480; the installs below come first and are not counted).
#
# Runs from the repository root with $PYTHON (default python3): it needs torch, transformers, tokenizers and
# pyyaml. The reward library needs math-verify, and the ZeRO-2 check DeepSpeed; a GPU image without them
# (no registry in reach) takes them from SMOKE_WHEELS (default ../shared/wheels, beside the repository): its
# wheels and DeepSpeed's source distribution go into a scratch --target that PYTHONPATH names for this script
# and the `grpoflow train` subprocesses, each only when its distribution is not installed already (the
# image's own packages stay as they are). DeepSpeed is built with --no-build-isolation against the image's
# torch and DS_BUILD_OPS=0: no op is compiled, and the trainer hands DeepSpeed torch's AdamW, so none is
# compiled at run time on a GPU either. SMOKE_PYTHONPATH adds a directory of packages of your own.
# vLLM and LMDeploy wheels pin torch exactly and are far larger than a lent machine's 64 MiB working tree:
# there the vLLM / LMDeploy checks are skipped and the layouts use the transformers engine.
# `--device cpu` runs everything that needs no CUDA small (LMDeploy has no CPU backend; the memory plan's
# check needs the CUDA allocator's counters), with 2 gloo trainer ranks for the async layout.
#
# Usage: infra/gpu/smoke.sh [smoke.py options]   e.g. infra/gpu/smoke.sh --device cpu
# The JSON result goes to stdout and to $OUT/smoke.json when OUT is set; the exit status is non-zero when a
# check fails (124 when SMOKE_TIMEOUT_S runs out).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
wheels=${SMOKE_WHEELS:-../shared/wheels}
if [ -d "$wheels" ]; then
  # the wheels (*.whl) and source distributions (*.tar.gz) of distributions this Python does not have
  mapfile -t missing < <("$PYTHON" - "$wheels" <<'PY'
import importlib.metadata, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).iterdir()):
    if f.name.endswith((".whl", ".tar.gz")):
        try:  # a file name starts with its distribution's name, then "-" and the version
            importlib.metadata.version(f.name.split("-")[0])
        except importlib.metadata.PackageNotFoundError:
            print(f)
PY
  )
  if [ "${#missing[@]}" -gt 0 ]; then
    site=$(mktemp -d /tmp/grpoflow-smoke-site.XXXXXX)
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    pip_target=("$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site")
    whl=() sdist=()
    for f in "${missing[@]}"; do
      case "$f" in *.whl) whl+=("$f") ;; *) sdist+=("$f") ;; esac
    done
    echo "installing into $site: ${missing[*]##*/}"
    [ "${#whl[@]}" -eq 0 ] || "${pip_target[@]}" "${whl[@]}" \
      || echo "could not install the wheels: what needs them fails naming the missing module" >&2
    for f in "${sdist[@]}"; do  # DeepSpeed: its build imports torch and sees the wheels above on PYTHONPATH
      DS_BUILD_OPS=0 "${pip_target[@]}" --no-build-isolation "$f" \
        || echo "could not build ${f##*/}: the checks that need it report it missing" >&2
    done
  fi
fi
if [ -n "${SMOKE_PYTHONPATH:-}" ]; then
  export PYTHONPATH="$SMOKE_PYTHONPATH${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
"$PYTHON" - <<'PY'
import importlib.metadata, importlib.util, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
for name in ("transformers", "math-verify", "deepspeed", "vllm", "lmdeploy"):
    try:
        print(f"  {name} {importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
        print(f"  {name}: not installed")
if importlib.util.find_spec("deepspeed"):  # its import needs packages its wheel set may lack (einops, msgpack)
    try:
        import deepspeed  # noqa: F401
    except Exception as e:
        print(f"  deepspeed does not import: {type(e).__name__}: {e}")
PY
exec timeout "${SMOKE_TIMEOUT_S:-480}" "$PYTHON" infra/gpu/smoke.py "$@"
