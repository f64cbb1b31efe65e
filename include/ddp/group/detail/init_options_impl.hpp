#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The definitions of group/init_options.hpp that read this process's environment: included by
// it in a header-only build, compiled once by src/ddp.cpp with DDP_SEPARATE_COMPILATION
// (detail/compiled.hpp).

#include <cstdlib>

#include <ddp/detail/compiled.hpp>
#include <ddp/group/init_options.hpp>

namespace ddp {
inline namespace DDP_ABI {

DDP_DECL init_options init_options::from_env() {
  return from_env([](const char* n) { return std::getenv(n); });
}

}  // namespace DDP_ABI
}  // namespace ddp
