// Trains for a long time with ddp::data_parallel's default reducer, so that a test can cut a
// link while steps run (tests/netns/test_netns.sh). Started like any rank (ddprun, or
// RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT by hand):
//
//   netns_train [STEPS]      (default 1000000)
//
// Prints "rank R: step N" every 20 steps (the test waits for it before cutting) and
// "rank R: done after N steps" at the end. On a ddp::error it prints, on stderr and before the
// group closes, "rank R: failed at step N, at T: <what()>" (T: seconds since the epoch, the
// moment the error reached the program) and exits 1; any other failure exits 2.
// Built with libsodium (DDP_NETNS_AUTH), it installs ddp's authenticator, so that the group
// can run with a DDP_AUTH_TOKEN beyond loopback (docs/security.md).
#include <ddp/data_parallel.hpp>
#include <ddp/ddp.hpp>
#ifdef DDP_NETNS_AUTH
#include <ddp/auth/sodium.hpp>
#endif

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

double epoch_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  const long steps = argc > 1 ? std::atol(argv[1]) : 1000000;
  int rank = -1;
  long step = 0;
  try {
    using namespace ddp::literals;
#ifdef DDP_NETNS_AUTH
    ddp::install_authenticator(&ddp::sodium_authenticator::make);
#endif
    auto pg = ddp::init_process_group(ddp::init_options::from_env());
    rank = pg.rank();
    // Three layers' worth of gradients (1 MiB), in several buckets.
    std::vector<std::vector<float>> values{std::vector<float>(65536), std::vector<float>(256),
                                           std::vector<float>(131072), std::vector<float>(256),
                                           std::vector<float>(65536), std::vector<float>(16)};
    std::vector<std::vector<float>> grads;
    std::vector<std::string> names;
    for (std::size_t i = 0; i < values.size(); ++i) {
      grads.emplace_back(values[i].size());
      names.push_back("p" + std::to_string(i));
    }
    std::vector<ddp::tensor_view> params;
    for (std::size_t i = 0; i < values.size(); ++i)
      params.push_back(ddp::make_tensor_view(values[i], grads[i], names[i]));
    ddp::data_parallel dp{pg, params, ddp::bucket_policy{.cap_bytes = 256_KiB, .first_cap_bytes = 64_KiB}};
    try {
      for (step = 0; step < steps; ++step) {
        // Backward, last parameter first; rank r's gradient is r, so the average is known.
        for (std::size_t i = grads.size(); i-- > 0;) {
          for (auto& g : grads[i]) g = static_cast<float>(rank);
          dp.grad_ready(i);
        }
        dp.finish();
        const float want = static_cast<float>(pg.size() - 1) / 2.0f;
        if (grads[2][7] != want) {
          std::fprintf(stderr, "rank %d: step %ld: averaged gradient %g, expected %g\n", rank, step, grads[2][7], want);
          return 2;
        }
        if (step % 20 == 0) {
          std::printf("rank %d: step %ld\n", rank, step);
          std::fflush(stdout);
        }
      }
    } catch (const ddp::error& e) {
      // Said here, before the wrapper and the group close (rank 0's close waits a moment for
      // its peers to leave the store).
      std::fprintf(stderr, "rank %d: failed at step %ld, at %.3f: %s\n", rank, step, epoch_seconds(), e.what());
      return 1;
    }
    std::printf("rank %d: done after %ld steps\n", rank, step);
    return 0;
  } catch (const ddp::error& e) {
    std::fprintf(stderr, "rank %d: failed at step %ld, at %.3f: %s\n", rank, step, epoch_seconds(), e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: failed at step %ld: unexpected %s\n", rank, step, e.what());
    return 2;
  }
}
