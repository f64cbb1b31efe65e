#include "ddp/transport/concept.hpp"

#include <doctest/doctest.h>

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ddp/concepts.hpp"
#include "ddp/bucket_tag.hpp"
#include "ddp/reducer/hooked.hpp"
#include "ddp/reducer/ring.hpp"
#include "ddp/reducer/shm.hpp"
#include "ddp/reducer/tree.hpp"
#include "ddp/transport/tcp.hpp"

namespace {

// The smallest type that models ddp::transport: exactly what the ring and tree algorithms call,
// with the arguments they pass, and nothing else.
struct transport_archetype {
  explicit transport_archetype(ddp::process_group&) {}
  int rank() const { return 0; }
  int size() const { return 1; }
  void send(int, const void*, std::size_t, ddp::deadline_t) {}
  void recv(int, void*, std::size_t, ddp::deadline_t) {}
  template <class OnRecv>
  void sendrecv(int, std::span<const iovec>, int, std::span<const iovec>, ddp::deadline_t, OnRecv&&) {}
  [[noreturn]] void fail(ddp::errc code, const std::string& msg) { ddp::detail::raise(code, 0, msg); }
  void abort() noexcept {}
};

// One requirement missing or wrong each.
struct no_sendrecv {
  explicit no_sendrecv(ddp::process_group&) {}
  int rank() const { return 0; }
  int size() const { return 1; }
  void send(int, const void*, std::size_t, ddp::deadline_t) {}
  void recv(int, void*, std::size_t, ddp::deadline_t) {}
  void sendrecv(int, const void*, std::size_t, int, void*, std::size_t, ddp::deadline_t) {}  // no iovec form
  [[noreturn]] void fail(ddp::errc code, const std::string& msg) { ddp::detail::raise(code, 0, msg); }
  void abort() noexcept {}
};
struct no_fail {
  explicit no_fail(ddp::process_group&) {}
  int rank() const { return 0; }
  int size() const { return 1; }
  void send(int, const void*, std::size_t, ddp::deadline_t) {}
  void recv(int, void*, std::size_t, ddp::deadline_t) {}
  template <class OnRecv>
  void sendrecv(int, std::span<const iovec>, int, std::span<const iovec>, ddp::deadline_t, OnRecv&&) {}
  void abort() noexcept {}
};
struct abort_may_throw {
  explicit abort_may_throw(ddp::process_group&) {}
  int rank() const { return 0; }
  int size() const { return 1; }
  void send(int, const void*, std::size_t, ddp::deadline_t) {}
  void recv(int, void*, std::size_t, ddp::deadline_t) {}
  template <class OnRecv>
  void sendrecv(int, std::span<const iovec>, int, std::span<const iovec>, ddp::deadline_t, OnRecv&&) {}
  [[noreturn]] void fail(ddp::errc code, const std::string& msg) { ddp::detail::raise(code, 0, msg); }
  void abort() {}
};
// A callback taken as a plain function pointer cannot receive the algorithms' capturing lambdas.
struct function_pointer_callback {
  explicit function_pointer_callback(ddp::process_group&) {}
  int rank() const { return 0; }
  int size() const { return 1; }
  void send(int, const void*, std::size_t, ddp::deadline_t) {}
  void recv(int, void*, std::size_t, ddp::deadline_t) {}
  void sendrecv(int, std::span<const iovec>, int, std::span<const iovec>, ddp::deadline_t, void (*)(std::size_t)) {}
  [[noreturn]] void fail(ddp::errc code, const std::string& msg) { ddp::detail::raise(code, 0, msg); }
  void abort() noexcept {}
};

static_assert(ddp::transport<transport_archetype>);
static_assert(ddp::transport<ddp::tcp>);
static_assert(!ddp::transport_has_sendrecv<no_sendrecv> && !ddp::transport<no_sendrecv>);
static_assert(!ddp::transport_has_fail<no_fail> && !ddp::transport<no_fail>);
static_assert(!ddp::transport_has_abort<abort_may_throw> && !ddp::transport<abort_may_throw>);
static_assert(!ddp::transport_has_sendrecv<function_pointer_callback>);
static_assert(!ddp::transport<int> && !ddp::transport<ddp::shm>);  // shm is an engine: ring<shm> runs on shm_engine

// The reducers over the archetype are reducers; mpi_reducer has no abort(), ring<T> does.
static_assert(ddp::reducer<ddp::ring<transport_archetype>> && ddp::reducer<ddp::tree<transport_archetype>>);
static_assert(requires(ddp::ring<transport_archetype> & r) { r.abort(); });

// Every reducer of ddp takes the bucket's tag with the call (ddp/bucket_tag.hpp); a reducer that
// hides those overloads behind its own four-argument allreduce_async is still a reducer, and the
// wrapper calls it without the tag (tests/multiproc's flaky_ring runs that path).
struct untagged_ring : ddp::ring<transport_archetype> {
  ddp::request allreduce_async(void* d, std::size_t n, ddp::dtype t, ddp::op o) {
    return ddp::ring<transport_archetype>::allreduce_async(d, n, t, o);
  }
};
static_assert(ddp::reducer_with_bucket_tag<ddp::ring<transport_archetype>> &&
              ddp::reducer_with_bucket_tag<ddp::tree<transport_archetype>> &&
              ddp::reducer_with_bucket_tag<ddp::hooked<ddp::ring<transport_archetype>>>);
static_assert(!ddp::reducer_with_bucket_tag<untagged_ring> && ddp::has_allreduce_async<untagged_ring>);

}  // namespace

// Every member function of the ring and tree engines, compiled over the archetype: an algorithm
// that called anything on a transport beyond ddp::transport would not compile here.
template class ddp::detail::p2p_engine<ddp::ring_algorithm, transport_archetype>;
template class ddp::detail::p2p_engine<ddp::tree_algorithm, transport_archetype>;

namespace {

// A transport between threads of this process, written against the concept alone: the
// algorithms run over it exactly as over tcp.
struct hub {
  explicit hub(int n) : n(n) {}
  int n;
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::pair<int, int>, std::deque<char>> queues;  // (from, to) -> bytes in flight
  bool failed = false;
};

class mailbox {
 public:
  explicit mailbox(ddp::process_group&) { ddp::detail::raise(ddp::errc::usage, -1, "mailbox: in-process only"); }
  mailbox(hub& h, int rank) : h_(&h), rank_(rank) {}
  int rank() const { return rank_; }
  int size() const { return h_->n; }
  void send(int peer, const void* data, std::size_t n, ddp::deadline_t) {
    {
      std::lock_guard lock(h_->mu);
      auto& q = h_->queues[{rank_, peer}];
      q.insert(q.end(), static_cast<const char*>(data), static_cast<const char*>(data) + n);
    }
    h_->cv.notify_all();
  }
  void recv(int peer, void* data, std::size_t n, ddp::deadline_t until) {
    std::unique_lock lock(h_->mu);
    auto& q = h_->queues[{peer, rank_}];
    if (!h_->cv.wait_until(lock, until, [&] { return h_->failed || q.size() >= n; }))
      ddp::detail::raise(ddp::errc::timeout, rank_, "mailbox: rank " + std::to_string(peer) + " sent nothing");
    if (q.size() < n) ddp::detail::raise(ddp::errc::aborted, rank_, "mailbox: a rank failed");
    std::copy(q.begin(), q.begin() + static_cast<std::ptrdiff_t>(n), static_cast<char*>(data));
    q.erase(q.begin(), q.begin() + static_cast<std::ptrdiff_t>(n));
  }
  template <class OnRecv>
  void sendrecv(int to, std::span<const iovec> out, int from, std::span<const iovec> in, ddp::deadline_t until,
                OnRecv&& on_recv) {
    for (const iovec& v : out) send(to, v.iov_base, v.iov_len, until);
    std::size_t got = 0;
    for (const iovec& v : in) {
      recv(from, v.iov_base, v.iov_len, until);
      got += v.iov_len;
      on_recv(got);
    }
  }
  [[noreturn]] void fail(ddp::errc code, const std::string& msg) {
    abort();
    ddp::detail::raise(code, rank_, msg);
  }
  void abort() noexcept {
    {
      std::lock_guard lock(h_->mu);
      h_->failed = true;
    }
    h_->cv.notify_all();
  }

 private:
  hub* h_;
  int rank_;
};
static_assert(ddp::transport<mailbox>);

struct outcome {
  std::vector<float> data;
  ddp::errc code{};
  std::string message;
};

template <class Algorithm>
std::vector<outcome> allreduce_on_threads(int n, std::size_t count, ddp::reducer_options opts, int odd_rank = -1) {
  hub h(n);
  std::vector<outcome> out(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      auto& o = out[static_cast<std::size_t>(r)];
      mailbox t(h, r);
      o.data.resize(count);
      for (std::size_t i = 0; i < count; ++i) o.data[i] = static_cast<float>(r + 1) + static_cast<float>(i % 7);
      const std::size_t mine = r == odd_rank ? count - 1 : count;
      ddp::detail::coll_desc d;
      d.kind = ddp::detail::coll_kind::allreduce;
      d.count = mine;
      d.seq = 1;
      d.algo =
          std::same_as<Algorithm, ddp::tree_algorithm> ? ddp::detail::coll_algo::tree : ddp::detail::coll_algo::ring;
      d.variant = ddp::detail::p2p_engine<Algorithm, mailbox>::variant(d.kind, mine * 4, opts);
      try {
        ddp::detail::p2p_allreduce<Algorithm>(t, d, ddp::steady_clock::now() + std::chrono::seconds(10), o.data.data(),
                                              mine, ddp::dtype::f32, ddp::op::sum, opts);
      } catch (const ddp::error& e) {
        o.code = e.condition();
        o.message = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace

TEST_CASE("ring and tree allreduce over a transport written against ddp::transport alone") {
  ddp::reducer_options opts;
  opts.segment_bytes = 64;
  for (int n : {2, 3, 4, 5}) {
    for (std::size_t count : {std::size_t{1}, std::size_t{10}, std::size_t{1000}}) {
      CAPTURE(n);
      CAPTURE(count);
      for (const auto& outs :
           {allreduce_on_threads<ddp::ring_algorithm>(n, count, opts),
            allreduce_on_threads<ddp::tree_algorithm>(n, count, opts),
            allreduce_on_threads<ddp::tree_algorithm>(n, count, ddp::reducer_options{.small_bytes = 0})}) {
        for (const auto& o : outs) {
          REQUIRE(o.message.empty());
          for (std::size_t i = 0; i < count; ++i) {
            const float expect =
                static_cast<float>(n * (n + 1) / 2) + static_cast<float>(n) * static_cast<float>(i % 7);
            REQUIRE(o.data[i] == expect);
          }
        }
      }
    }
  }
}

TEST_CASE("a peer whose descriptor differs: the transport's fail() raises errc::mismatch naming both calls") {
  for (const auto& outs : {allreduce_on_threads<ddp::ring_algorithm>(3, 100, {}, 1),
                           allreduce_on_threads<ddp::tree_algorithm>(4, 100, {}, 1)}) {
    int mismatches = 0;
    for (const auto& o : outs) {
      CHECK(o.code != ddp::errc{});  // every rank ends with an error, none waits for its deadline
      if (o.code != ddp::errc::mismatch) continue;
      ++mismatches;
      CHECK(o.message.find("collective mismatch") != std::string::npos);
      CHECK(o.message.find("of 100 x f32 sum") != std::string::npos);
      CHECK(o.message.find("of 99 x f32 sum") != std::string::npos);
    }
    CHECK(mismatches >= 1);
  }
}
