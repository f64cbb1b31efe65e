#!/usr/bin/env bash
# Installs, with apt, whatever of ddp's build and test dependencies is missing.
#   scripts/deps.sh            core + tests (compiler, Meson, doctest, oneTBB, Open MPI, Gloo, libsodium,
#                              clang with libFuzzer for the fuzz targets, Slurm and MUNGE for the
#                              `slurm` suite's one-node cluster, LibTorch and PyTorch for the `torch`
#                              suite's side-by-side run, Eigen for the `eigen` suite, dlib for the `dlib` suite,
#                              clang-format for the `format` check of include/, etcd with libcurl and
#                              nlohmann/json for the `etcd` suite's real three-member cluster)
#   scripts/deps.sh bench      also the benchmark peers' Python side (PyTorch, matplotlib)
set -euo pipefail
pkgs=(g++ meson ninja-build pkg-config cmake doctest-dev libtbb-dev libopenmpi-dev openmpi-bin
      libgloo-dev libsodium-dev python3 iproute2 clang libclang-rt-14-dev slurm-wlm munge
      libtorch-dev python3-torch libeigen3-dev libdlib-dev clang-format
      etcd-server etcd-client libcurl4-openssl-dev nlohmann-json3-dev)
if [[ "${1:-}" == bench ]]; then pkgs+=(python3-matplotlib python3-numpy); fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "deps: installing ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
