#pragma once
// What the code blocks of README.md and docs/*.md take as given: a group, a wrapper, a
// training engine with its parameters and data. check_snippets.py compiles each block inside a
// function that declares these first (declared only: the blocks are compiled, not run).

#include <ddp/ddp.hpp>

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <span>
#include <vector>

namespace doc_context {

struct batch {};

/// A training engine as the docs use it: forward, backward with a per-parameter hook, step.
struct engine_t {
  void forward(const batch&) {}
  template <class Hook>
  void backward(Hook&& hook) {
    hook(std::size_t{0});
  }
  void step() {}
};

ddp::process_group& group();
ddp::data_parallel& wrapper();
ddp::init_options& options();

}  // namespace doc_context

void train(ddp::process_group& pg, ddp::data_parallel& dp);

// The names, declared in the snippet function before the block (which may shadow them).
#define DDP_DOC_CONTEXT                                                    \
  [[maybe_unused]] auto& pg = doc_context::group();                         \
  [[maybe_unused]] auto& dp = doc_context::wrapper();                       \
  [[maybe_unused]] auto& opts = doc_context::options();                     \
  [[maybe_unused]] doc_context::engine_t engine;                            \
  [[maybe_unused]] std::vector<ddp::tensor_view> params, engine_params;     \
  [[maybe_unused]] std::vector<doc_context::batch> shard, micro(4);         \
  [[maybe_unused]] int micro_steps = 4, r = 0, rank = 0;                    \
  [[maybe_unused]] std::size_t n = 1024;                                    \
  [[maybe_unused]] std::vector<float> v(n);                                 \
  [[maybe_unused]] std::vector<double> w(n);
