#pragma once
/// \file sampler.hpp
/// `ddp::distributed_sampler`: which samples of a dataset this rank trains on, epoch by epoch,
/// laid out as PyTorch's `torch.utils.data.DistributedSampler` lays them out; and the fixed
/// pseudo-random generators its shuffle uses (`ddp::splitmix64`, `ddp::xoshiro256ss`), so
/// that any program, in any language, can reproduce an epoch's order. See docs/training-loop.md.
///
/// \code
/// ddp::distributed_sampler sampler{pg, dataset.size(), {.shuffle = true, .seed = 42}};
/// for (std::uint64_t epoch = 0; epoch < epochs; ++epoch) {
///   sampler.set_epoch(epoch);
///   for (std::uint64_t i : sampler) train_on(dataset[i]);
/// }
/// \endcode

#include <compare>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// SplitMix64 (Steele, Lea, Flood 2014; Vigna's reference `splitmix64.c`): adds
/// 0x9e3779b97f4a7c15 to its state, then mixes. Used to seed `xoshiro256ss`.
///
/// \code
/// ddp::splitmix64 g{0};
/// assert(g() == 0xe220a8397b1dcdafull);
/// \endcode
class splitmix64 {
 public:
  using result_type = std::uint64_t;
  explicit constexpr splitmix64(std::uint64_t seed) noexcept : s_(seed) {}
  constexpr std::uint64_t operator()() noexcept {
    std::uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  static constexpr std::uint64_t min() noexcept { return 0; }
  static constexpr std::uint64_t max() noexcept { return std::numeric_limits<std::uint64_t>::max(); }

 private:
  std::uint64_t s_;
};

/// xoshiro256** 1.0 (Blackman and Vigna 2018), its four state words the first four outputs of
/// `splitmix64{seed}`, as the authors recommend. Its output is fixed by this definition on
/// every platform, unlike `std::uniform_int_distribution`'s.
class xoshiro256ss {
 public:
  using result_type = std::uint64_t;
  explicit constexpr xoshiro256ss(std::uint64_t seed) noexcept {
    splitmix64 sm(seed);
    for (auto& w : s_) w = sm();
  }
  constexpr std::uint64_t operator()() noexcept {
    const std::uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const std::uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  /// A uniform integer in [0, bound), bound >= 1, by rejection: draws below
  /// 2^64 mod bound are redrawn, then the draw is taken modulo `bound` (unbiased).
  constexpr std::uint64_t below(std::uint64_t bound) noexcept {
    const std::uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
    for (;;) {
      const std::uint64_t r = (*this)();
      if (r >= threshold) return r % bound;
    }
  }
  static constexpr std::uint64_t min() noexcept { return 0; }
  static constexpr std::uint64_t max() noexcept { return std::numeric_limits<std::uint64_t>::max(); }

 private:
  static constexpr std::uint64_t rotl(std::uint64_t x, int k) noexcept { return (x << k) | (x >> (64 - k)); }
  std::uint64_t s_[4] = {};
};

/// Tunables of `distributed_sampler`; the defaults are PyTorch's.
struct sampler_options {
  bool shuffle = true;     ///< a new order each epoch (the same on every rank); false: 0, 1, 2, ...
  std::uint64_t seed = 0;  ///< must be the same on every rank
  /// false: pad with indices from the start of the (shuffled) order until every rank has
  /// ceil(n / world) samples; true: drop the tail so every rank has floor(n / world).
  bool drop_last = false;
  friend bool operator==(const sampler_options&, const sampler_options&) = default;
};

/// The indices of the samples one rank trains on in one epoch, as PyTorch's
/// `DistributedSampler` chooses them:
///
/// 1. the order: `0, 1, ..., n-1`, or with `shuffle` a permutation that depends only on
///    `seed + epoch` (below), the same on every rank;
/// 2. the total: `world * size()` indices, where `size()` is `ceil(n / world)` (the order is
///    extended by repeating it from its start, as often as needed when `n < world`) or, with
///    `drop_last`, `floor(n / world)` (the order's tail is cut);
/// 3. this rank's share: positions `rank, rank + world, rank + 2 world, ...` of that total.
///
/// So the ranks' shares are disjoint and cover the dataset, except for the padding (which
/// repeats samples) or the dropped tail. The shuffle is a Fisher-Yates shuffle driven by
/// `xoshiro256ss{seed + epoch}` (wrapping): for i = n-1 down to 1, swap positions i and
/// `below(i + 1)`. It is not PyTorch's `torch.randperm` (whose output is PyTorch's own), but is
/// fixed by this definition on every platform. A shuffled epoch holds the whole permutation,
/// 8 bytes per sample, while `set_epoch` builds it, then this rank's share; without shuffle
/// nothing is stored and indices are computed as they are read.
///
/// Not a collective: it needs only the rank and the world size (a `process_group`, or any
/// object with `rank()` and `size()`, gives both).
///
/// \code
/// ddp::distributed_sampler s{10, /*rank=*/1, /*world=*/4, {.shuffle = false}};
/// // s.size() == 3; s yields 1, 5, 9
/// \endcode
class distributed_sampler {
 public:
  /// errc::invalid_argument when `world < 1` or `rank` is outside [0, world).
  distributed_sampler(std::uint64_t dataset_size, int rank, int world, sampler_options options = {})
      : n_(dataset_size), rank_(rank), world_(world), opts_(options) {
    if (world < 1)
      detail::raise(errc::invalid_argument, rank,
                    "distributed_sampler: world size " + std::to_string(world) + " (must be at least 1)");
    if (rank < 0 || rank >= world)
      detail::raise(
          errc::invalid_argument, rank,
          "distributed_sampler: rank " + std::to_string(rank) + " is outside [0, " + std::to_string(world) + ")");
    share();
  }

  /// The rank and size of `group` (a `ddp::process_group`, or anything with `rank()` and `size()`).
  template <class Group>
  requires requires(const Group& g) {
    { g.rank() } -> std::convertible_to<int>;
    { g.size() } -> std::convertible_to<int>;
  }
  distributed_sampler(const Group& group, std::uint64_t dataset_size, sampler_options options = {})
      : distributed_sampler(dataset_size, static_cast<int>(group.rank()), static_cast<int>(group.size()), options) {}

  /// Chooses the epoch whose order the sampler yields (as PyTorch's `set_epoch`): call it with
  /// the same value on every rank before each epoch, or every epoch has epoch 0's order.
  void set_epoch(std::uint64_t epoch) {
    if (epoch == epoch_ && start_ == 0) return;
    epoch_ = epoch;
    start_ = 0;
    share();
  }
  /// Resumes epoch `epoch` after the group trained on the first `consumed` positions of its
  /// order (all ranks together, in whatever world they were: a world of w that took k steps of
  /// b samples per rank from a share consumed k * b * w): this rank's share is then the rest of
  /// the order, positions `consumed + rank, consumed + rank + world, ...`, dealt over this
  /// sampler's world, padded or cut as `drop_last` says. An elastic group that changed size
  /// in the middle of an epoch (docs/elastic.md) thus neither skips a sample nor sees one twice
  /// (but for the padding). errc::invalid_argument when `consumed` exceeds the dataset.
  void resume(std::uint64_t epoch, std::uint64_t consumed) {
    if (consumed > n_)
      detail::raise(errc::invalid_argument, rank_,
                    "distributed_sampler: resume after " + std::to_string(consumed) + " samples of a dataset of " +
                        std::to_string(n_));
    epoch_ = epoch;
    start_ = consumed;
    share();
  }
  /// Positions of the epoch's order taken before this share (resume), 0 after set_epoch.
  std::uint64_t start() const noexcept { return start_; }
  std::uint64_t epoch() const noexcept { return epoch_; }

  /// Samples this rank yields per epoch: ceil(n / world), or floor(n / world) with drop_last.
  std::uint64_t size() const noexcept { return per_rank_; }
  bool empty() const noexcept { return per_rank_ == 0; }
  /// Samples all ranks together yield per epoch: world * size().
  /// (2^64 - 1 when that does not fit in 64 bits: n within `world` of 2^64.)
  std::uint64_t total_size() const noexcept {
    const auto w = static_cast<std::uint64_t>(world_);
    return per_rank_ > std::numeric_limits<std::uint64_t>::max() / w ? std::numeric_limits<std::uint64_t>::max()
                                                                     : per_rank_ * w;
  }
  std::uint64_t dataset_size() const noexcept { return n_; }
  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return world_; }
  const sampler_options& options() const noexcept { return opts_; }

  /// The i-th index of this rank's share, i < size().
  std::uint64_t operator[](std::uint64_t i) const noexcept {
    return opts_.shuffle ? mine_[static_cast<std::size_t>(i)] : position(i);
  }

  /// A random-access iterator over this rank's share.
  class iterator {
   public:
    using iterator_category = std::random_access_iterator_tag;
    using iterator_concept = std::random_access_iterator_tag;
    using value_type = std::uint64_t;
    using difference_type = std::int64_t;
    using reference = std::uint64_t;
    using pointer = void;

    iterator() = default;
    std::uint64_t operator*() const noexcept { return (*s_)[i_]; }
    std::uint64_t operator[](difference_type k) const noexcept { return (*s_)[i_ + static_cast<std::uint64_t>(k)]; }
    iterator& operator++() noexcept {
      ++i_;
      return *this;
    }
    iterator operator++(int) noexcept {
      auto t = *this;
      ++i_;
      return t;
    }
    iterator& operator--() noexcept {
      --i_;
      return *this;
    }
    iterator operator--(int) noexcept {
      auto t = *this;
      --i_;
      return t;
    }
    iterator& operator+=(difference_type k) noexcept {
      i_ += static_cast<std::uint64_t>(k);
      return *this;
    }
    iterator& operator-=(difference_type k) noexcept {
      i_ -= static_cast<std::uint64_t>(k);
      return *this;
    }
    friend iterator operator+(iterator it, difference_type k) noexcept { return it += k; }
    friend iterator operator+(difference_type k, iterator it) noexcept { return it += k; }
    friend iterator operator-(iterator it, difference_type k) noexcept { return it -= k; }
    friend difference_type operator-(const iterator& a, const iterator& b) noexcept {
      return static_cast<difference_type>(a.i_ - b.i_);
    }
    friend bool operator==(const iterator& a, const iterator& b) noexcept { return a.i_ == b.i_; }
    friend auto operator<=>(const iterator& a, const iterator& b) noexcept { return a.i_ <=> b.i_; }

   private:
    friend class distributed_sampler;
    iterator(const distributed_sampler* s, std::uint64_t i) noexcept : s_(s), i_(i) {}
    const distributed_sampler* s_ = nullptr;
    std::uint64_t i_ = 0;
  };

  iterator begin() const noexcept { return {this, 0}; }
  iterator end() const noexcept { return {this, per_rank_}; }

  /// This rank's share as a vector (what PyTorch's `list(iter(sampler))` gives).
  std::vector<std::uint64_t> indices() const { return {begin(), end()}; }

 private:
  // Where the i-th index of this rank's share sits in the order: position rank + i * world of
  // the padded order, which repeats the order from its start, so modulo n (n >= 1 whenever
  // size() >= 1). Computed without overflow for any n: i * world < n because i < size().
  // After resume(epoch, start) the same holds for the rest of the order, [start, n).
  std::uint64_t position(std::uint64_t i) const noexcept {
    const std::uint64_t m = n_ - start_;
    const std::uint64_t q = i * static_cast<std::uint64_t>(world_);
    const std::uint64_t r = static_cast<std::uint64_t>(rank_) % m;
    return start_ + (r >= m - q ? r - (m - q) : q + r);
  }

  // This rank's count, then its share (with shuffle) of the positions from start_ on.
  void share() {
    const auto w = static_cast<std::uint64_t>(world_);
    const std::uint64_t m = n_ - start_;
    // Written so that nothing overflows, up to n = 2^64 - 1.
    per_rank_ = opts_.drop_last ? m / w : m / w + (m % w != 0 ? 1 : 0);
    build();
  }

  // With shuffle: this epoch's permutation, then this rank's share of the padded or cut order.
  void build() {
    mine_.clear();
    if (!opts_.shuffle || per_rank_ == 0) return;
    if (n_ > std::vector<std::uint64_t>().max_size() || per_rank_ > std::vector<std::uint64_t>().max_size())
      detail::raise(errc::invalid_argument, rank_,
                    "distributed_sampler: a shuffled dataset of " + std::to_string(n_) +
                        " samples does not fit in memory (8 bytes per sample); use shuffle = false");
    std::vector<std::uint64_t> order(static_cast<std::size_t>(n_));
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    xoshiro256ss g(opts_.seed + epoch_);
    for (std::size_t i = order.size() - 1; i > 0; --i)
      std::swap(order[i], order[static_cast<std::size_t>(g.below(i + 1))]);
    mine_.resize(static_cast<std::size_t>(per_rank_));
    for (std::uint64_t i = 0; i < per_rank_; ++i)
      mine_[static_cast<std::size_t>(i)] = order[static_cast<std::size_t>(position(i))];
  }

  std::uint64_t n_;
  int rank_;
  int world_;
  sampler_options opts_;
  std::uint64_t per_rank_ = 0;
  std::uint64_t epoch_ = 0;
  std::uint64_t start_ = 0;  // positions of the order taken before this share (resume)
  std::vector<std::uint64_t> mine_;
};

}  // namespace DDP_ABI
}  // namespace ddp
