#pragma once
// What the code blocks of README.md and docs/*.md take as given: a group, a wrapper, a
// training engine with its parameters and data. check_snippets.py compiles each block inside a
// function that declares these first (declared only: the blocks are compiled, not run).
//
// This header hides no include. A block with #include lines of its own must compile with those
// alone: the names below are then declared over ddp's classes declared, not defined, so a block
// that calls into a header it did not include fails; `dp` and `train` exist only when the block
// included the wrapper (check_snippets.py defines DDP_DOC_WRAPPER). A block with no #include
// line is a fragment of a program that includes <ddp/ddp.hpp>, and gets just that
// (DDP_DOC_UMBRELLA).

#ifdef DDP_DOC_UMBRELLA
#include <ddp/ddp.hpp>
#endif

#include <cstddef>
#include <vector>

namespace ddp {
inline namespace DDP_ABI {
class process_group;
struct init_options;
struct tensor_view;
}  // namespace DDP_ABI
}  // namespace ddp

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
ddp::init_options& options();
std::vector<ddp::tensor_view>& parameters();

}  // namespace doc_context

#ifdef DDP_DOC_WRAPPER
namespace doc_context {
ddp::data_parallel& wrapper();
}
void train(ddp::process_group& pg, ddp::data_parallel& dp);
#define DDP_DOC_WRAPPER_CONTEXT [[maybe_unused]] auto& dp = doc_context::wrapper();
#else
#define DDP_DOC_WRAPPER_CONTEXT
#endif

// The names, declared in the snippet function before the block (which may shadow them).
#define DDP_DOC_CONTEXT                                                    \
  [[maybe_unused]] auto& pg = doc_context::group();                         \
  DDP_DOC_WRAPPER_CONTEXT                                                   \
  [[maybe_unused]] auto& opts = doc_context::options();                     \
  [[maybe_unused]] doc_context::engine_t engine;                            \
  [[maybe_unused]] auto& params = doc_context::parameters();                \
  [[maybe_unused]] auto& engine_params = doc_context::parameters();         \
  [[maybe_unused]] std::vector<doc_context::batch> shard, micro(4);         \
  [[maybe_unused]] int micro_steps = 4, r = 0, rank = 0;                    \
  [[maybe_unused]] std::size_t n = 1024;                                    \
  [[maybe_unused]] std::vector<float> v(n);                                 \
  [[maybe_unused]] std::vector<double> w(n);
