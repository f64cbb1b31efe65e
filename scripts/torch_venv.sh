# PyPI's current torch in a virtual environment, installed where missing; sourced by the scripts
# that need it (torch_current.sh, fsdp2_loss_curve.sh). Sets py (its python), version, prefix
# (torch's package directory, a LibTorch) and abi (_GLIBCXX_USE_CXX11_ABI).
#   DDP_TORCH_VENV=DIR      the virtual environment (default /opt/ddp-torch-venv)
#   DDP_TORCH_VERSION=2.x.y a given release instead of PyPI's newest
# Installs `torch` without its dependencies, then those it declares for this platform except
# triton (torch.compile's compiler, unused here). A venv that imports torch is reused as it is.
venv=${DDP_TORCH_VENV:-/opt/ddp-torch-venv}
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
[[ -n "${abi:-}" ]] || { echo "torch_venv.sh: $py does not import torch with gloo" >&2; exit 1; }
echo "torch_venv.sh: torch $version at $prefix (_GLIBCXX_USE_CXX11_ABI=$abi)"
