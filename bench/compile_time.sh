#!/usr/bin/env bash
# Compile time of ddp beside well-known header-only libraries, on this machine, in one sitting.
#
#   bench/compile_time.sh [RUNS] [CXX]      RUNS per row (default 5), CXX (default c++)
#
# Each row is a one-file translation unit, compiled RUNS times; the table gives the median
# wall time, the preprocessed size, and the ratio to nlohmann/json's `-fsyntax-only` (the
# reference the issue tracker's targets use). Rows:
#   - `#include` alone, -fsyntax-only: ddp's umbrella, fmt, nlohmann/json, Asio, Eigen, and the
#     standard headers that ddp's umbrella pulls in (the floor of any header-only ddp);
#   - one instantiated `ddp::data_parallel` (a wrapper over a parameter list, one step):
#     with <ddp/ddp.hpp>, and in compiled mode with <ddp/core.hpp> (the default path alone) too;
#     -fsyntax-only, -O0 and -O2 to an object file; with DDP_SEPARATE_COMPILATION too (the
#     compiled mode: the group's and the default reducer's code compiles once, in src/ddp.cpp,
#     whose own time is a row of its own);
#   - the LibTorch adapter: one `ddp::torch_data_parallel` over a module, beside
#     `#include <torch/torch.h>` alone (what any LibTorch unit pays), -fsyntax-only.
# Missing reference libraries are installed with apt when run as root (nlohmann-json3-dev,
# libfmt-dev, libasio-dev, libeigen3-dev); rows whose headers are absent are skipped.
set -uo pipefail
runs=${1:-5}
cxx=${2:-c++}
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

want=(nlohmann-json3-dev libfmt-dev libasio-dev libeigen3-dev)
missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2> /dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})) && [[ $(id -u) -eq 0 ]]; then
  echo "compile_time: installing ${missing[*]}" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" > /dev/null
fi

cat > "$tmp/ddp.cpp" << 'EOF'
#include <ddp/ddp.hpp>
EOF
printf '#include <ddp/core.hpp>\n' > "$tmp/core.cpp"
cat > "$tmp/json.cpp" << 'EOF'
#include <nlohmann/json.hpp>
EOF
cat > "$tmp/fmt.cpp" << 'EOF'
#include <fmt/format.h>
EOF
cat > "$tmp/asio.cpp" << 'EOF'
#include <asio.hpp>
EOF
cat > "$tmp/eigen.cpp" << 'EOF'
#include <Eigen/Dense>
EOF
# The standard and system headers the umbrella includes, alone.
printf '#include <ddp/ddp.hpp>\n' > "$tmp/probe.cpp"
grep -h '^[[:space:]]*#[[:space:]]*include[[:space:]]*<' $("$cxx" -std=c++20 -I"$root/include" -H -fsyntax-only \
  "$tmp/probe.cpp" 2>&1 >/dev/null | grep -E '^\.+ ' | awk '{print $2}' | grep "$root/include") |
  grep -v 'ddp/\|ddp needs' | sed 's/[[:space:]]*\/\/.*//' | sort -u > "$tmp/std.cpp"

cat > "$tmp/wrapper.cpp" << 'EOF'
// One data-parallel wrapper over a parameter list, one step: what a user's training file holds.
#include <ddp/ddp.hpp>
#include <vector>
int main() {
  auto pg = ddp::init_process_group(ddp::init_options::from_env());
  std::vector<float> w(1000), g(1000);
  std::vector<ddp::tensor_view> params{ddp::make_tensor_view(w, g, "w")};
  ddp::data_parallel dp{pg, params};
  dp.grad_ready(0);
  dp.finish();
  return static_cast<int>(dp.size());
}
EOF
# The same from the default path's header (compiled mode's lighter include).
sed 's|<ddp/ddp.hpp>|<ddp/core.hpp>|' "$tmp/wrapper.cpp" > "$tmp/wrapper_core.cpp"
cat > "$tmp/torch_alone.cpp" << 'EOF'
#include <torch/torch.h>
EOF
cat > "$tmp/torch_dp.cpp" << 'EOF'
// One LibTorch module under ddp::torch_data_parallel, one step.
#include <ddp/adapters/libtorch.hpp>
#include <torch/torch.h>
int main() {
  auto pg = ddp::init_process_group(ddp::init_options::from_env());
  torch::nn::Linear net(16, 4);
  ddp::torch_data_parallel dp{pg, *net};
  auto loss = net->forward(torch::ones({2, 16})).sum();
  loss.backward();  // averaged when backward returns
  return 0;
}
EOF

torch_flags=(-isystem /usr/include/torch/csrc/api/include)
json_median=""
# row NAME FILE FLAGS...: median of $runs compiles, preprocessed lines, ratio to json.
row() {
  local name=$1 file=$2
  shift 2
  local times=() t lines
  if ! "$cxx" -std=c++20 "$@" "$file" -o "$tmp/out.o" 2> "$tmp/err"; then
    printf '| %-44s | %8s | %9s | %7s | skipped: %s |\n' "$name" - - - "$(grep -m1 error "$tmp/err" | cut -c1-60)"
    return
  fi
  for ((i = 0; i < runs; ++i)); do
    /usr/bin/time -f %e -o "$tmp/t" "$cxx" -std=c++20 "$@" "$file" -o "$tmp/out.o" > /dev/null 2>&1
    times+=("$(tail -1 "$tmp/t")")
  done
  local med
  med=$(printf '%s\n' "${times[@]}" | sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}')
  lines=$("$cxx" -std=c++20 "$@" -E "$file" 2> /dev/null | wc -l)
  [[ -z $json_median ]] && json_median=$med
  printf '| %-44s | %8.2f | %9d | %6.2fx | %s |\n' "$name" "$med" "$lines" \
    "$(awk -v a="$med" -v b="$json_median" 'BEGIN {print (b > 0) ? a / b : 0}')" "$(printf '%s ' "${times[@]}")"
}

inc=(-I"$root/include")
echo "compile_time: $("$cxx" --version | head -1), $(nproc) cores, $runs runs per row, median wall seconds"
echo
echo '| translation unit | median s | lines (-E) | / json | runs |'
echo '|---|---|---|---|---|'
row 'nlohmann/json: #include, -fsyntax-only' "$tmp/json.cpp" -fsyntax-only
row 'fmt: #include <fmt/format.h>, -fsyntax-only' "$tmp/fmt.cpp" -fsyntax-only
row 'Asio: #include <asio.hpp>, -fsyntax-only' "$tmp/asio.cpp" -fsyntax-only
row 'Eigen: #include <Eigen/Dense>, -fsyntax-only' "$tmp/eigen.cpp" -isystem /usr/include/eigen3 -fsyntax-only
row "the umbrella's system headers alone" "$tmp/std.cpp" -fsyntax-only
row 'ddp: #include <ddp/ddp.hpp>, -fsyntax-only' "$tmp/ddp.cpp" "${inc[@]}" -fsyntax-only
row 'ddp: one data_parallel, -fsyntax-only' "$tmp/wrapper.cpp" "${inc[@]}" -fsyntax-only
row 'ddp: one data_parallel, -O0 -c' "$tmp/wrapper.cpp" "${inc[@]}" -O0 -c
row 'ddp: one data_parallel, -O2 -c' "$tmp/wrapper.cpp" "${inc[@]}" -O2 -c
if [[ -f $root/src/ddp.cpp ]]; then
  row 'ddp compiled mode: #include <ddp/ddp.hpp>, -fsyntax-only' "$tmp/ddp.cpp" "${inc[@]}" -DDDP_SEPARATE_COMPILATION \
    -fsyntax-only
  row 'ddp compiled mode: one data_parallel, -O0 -c' "$tmp/wrapper.cpp" "${inc[@]}" -DDDP_SEPARATE_COMPILATION -O0 -c
  row 'ddp compiled mode: one data_parallel, -O2 -c' "$tmp/wrapper.cpp" "${inc[@]}" -DDDP_SEPARATE_COMPILATION -O2 -c
  # <ddp/core.hpp>: the default path alone (ddp.hpp has every name in both modes).
  row 'ddp compiled mode: #include <ddp/core.hpp>, -fsyntax-only' "$tmp/core.cpp" "${inc[@]}" \
    -DDDP_SEPARATE_COMPILATION -fsyntax-only
  row 'ddp compiled mode: core.hpp, one data_parallel, -O2 -c' "$tmp/wrapper_core.cpp" "${inc[@]}" \
    -DDDP_SEPARATE_COMPILATION -O2 -c
  row 'ddp compiled mode: src/ddp.cpp (once), -O2 -c' "$root/src/ddp.cpp" "${inc[@]}" -DDDP_SEPARATE_COMPILATION -O2 -c
fi
if [[ -f /usr/include/torch/csrc/api/include/torch/torch.h ]]; then
  row 'LibTorch: #include <torch/torch.h>, -fsyntax-only' "$tmp/torch_alone.cpp" "${torch_flags[@]}" -fsyntax-only
  row 'ddp: one torch_data_parallel, -fsyntax-only' "$tmp/torch_dp.cpp" "${inc[@]}" "${torch_flags[@]}" -fsyntax-only
fi
