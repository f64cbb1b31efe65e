#!/usr/bin/env bash
# The `torch` suite against the current LibTorch (PyPI's `torch` wheel carries its headers and
# libraries) instead of Debian's 1.13 (docs/testing.md, "The current LibTorch").
#   scripts/torch_current.sh           install into the venv if missing, configure, build, test
#   DDP_TORCH_VENV=DIR                 the virtual environment (default /opt/ddp-torch-venv)
#   DDP_TORCH_VERSION=2.x.y            a given release instead of PyPI's newest
#   DDP_TORCH_BUILD=DIR                the build directory (default build-torch-current)
# Installs `torch` without its dependencies, then those it declares for this platform except
# triton (torch.compile's compiler, unused here). The CUDA libraries stay: `import torch` loads
# libtorch_cuda.so, which links them, even on a machine without a GPU (torch 2.15: 2.7 GB to
# download, 4.4 GB installed). A venv that imports torch is reused as it is. Builds only the
# torch suite's targets; arguments go to meson test.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${DDP_TORCH_BUILD:-build-torch-current}
t0=$SECONDS
took() { echo "torch_current.sh: $1 took $((SECONDS - t0)) s"; t0=$SECONDS; }

source scripts/torch_venv.sh  # sets py, version, prefix, abi
took "installing or finding torch"

opts=(-Dtorch=enabled -Dtorch_prefix="$prefix" -Dcuda=disabled -Dnccl=disabled
      -Dmpi=disabled -Dauth=disabled -Deigen=disabled -Ddlib=disabled -Dbench=disabled)
if [[ -f "$build/build.ninja" ]]; then
  meson configure "$build" "${opts[@]}" >/dev/null
else
  meson setup "$build" --wrap-mode=nodownload "${opts[@]}" >/dev/null
fi
took "meson setup"
ninja -C "$build" -t targets all | sed -n 's/^\(tests\/torch\/[^:/]*\|examples\/03_libtorch\|tools\/ddprun\): .*/\1/p' |
  xargs nice -n 10 ninja -C "$build"
took "the build of the torch suite's targets"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
DDP_TORCH_PYTHON=$py meson test -C "$build" --no-rebuild --print-errorlogs --suite torch --verbose "$@"
took "meson test --suite torch"
