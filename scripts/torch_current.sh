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
venv=${DDP_TORCH_VENV:-/opt/ddp-torch-venv}
build=${DDP_TORCH_BUILD:-build-torch-current}
t0=$SECONDS
took() { echo "torch_current.sh: $1 took $((SECONDS - t0)) s"; t0=$SECONDS; }

if ! /usr/bin/python3 -c 'import venv, ensurepip' 2>/dev/null; then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
fi
[[ -x "$venv/bin/python" ]] || /usr/bin/python3 -m venv "$venv"
py=$venv/bin/python
want=torch${DDP_TORCH_VERSION:+==$DDP_TORCH_VERSION}
if ! "$py" -c 'import torch' 2>/dev/null || [[ -n "${DDP_TORCH_VERSION:-}" &&
     "$("$py" -c 'import torch; print(torch.__version__.split("+")[0])')" != "$DDP_TORCH_VERSION" ]]; then
  "$py" -m pip install --no-deps "$want"
  # torch's own requirements for this interpreter and platform, triton left out.
  mapfile -t reqs < <("$py" - <<'EOF'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
for r in map(Requirement, requires("torch") or []):
    if r.name != "triton" and (r.marker is None or r.marker.evaluate({"extra": ""})):
        print(r)
EOF
  )
  "$py" -m pip install "${reqs[@]}" numpy
fi
{ read -r version; read -r prefix; read -r abi; } < <("$py" -c '
import os, torch, torch.distributed as d
assert d.is_gloo_available(), "this torch has no gloo"
print(torch.__version__, os.path.dirname(torch.__file__), int(torch._C._GLIBCXX_USE_CXX11_ABI), sep="\n")')
[[ -n "${abi:-}" ]] || { echo "torch_current.sh: $py does not import torch with gloo" >&2; exit 1; }
echo "torch_current.sh: torch $version at $prefix (_GLIBCXX_USE_CXX11_ABI=$abi)"
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
