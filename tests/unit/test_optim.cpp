#include "ddp/optim/shard_optimizer.hpp"
#include "ddp/optim/adamw.hpp"
#include "ddp/optim/sgd.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "ddp/data_parallel/agreement.hpp"

// The shard optimizers' signature(), which ranks compare before the first step: hyperparameters
// that differ in any bit must give different signatures (six fixed decimals made lr 1e-6 and
// 1.4e-6 agree), equal ones equal signatures, and the text must still read as the numbers.

TEST_CASE("exact_text: the shortest text that reads back as the same double; distinct bits, distinct text") {
  CHECK(ddp::exact_text(1e-6) == "1e-06");
  CHECK(ddp::exact_text(1.4e-6) == "1.4e-06");
  CHECK(ddp::exact_text(0.9) == "0.9");
  CHECK(ddp::exact_text(0.999) == "0.999");
  CHECK(ddp::exact_text(0) == "0");
  CHECK(ddp::exact_text(-0.0) == "-0");
  const std::vector<double> values = {1e-6,
                                      1.4e-6,
                                      1e-8,
                                      1e-9,
                                      0.1,
                                      1.0 / 3,
                                      std::nextafter(1e-6, 1.0),
                                      std::numeric_limits<double>::denorm_min(),
                                      std::numeric_limits<double>::max(),
                                      std::numeric_limits<double>::lowest(),
                                      std::numeric_limits<double>::infinity()};
  for (const double v : values) {
    CAPTURE(v);
    CHECK(std::strtod(ddp::exact_text(v).c_str(), nullptr) == v);  // round trip: the text is the value
  }
  CHECK(ddp::exact_text(1e-6) != ddp::exact_text(std::nextafter(1e-6, 1.0)));  // one bit apart
  const double nan = std::numeric_limits<double>::quiet_NaN();
  CHECK(ddp::exact_text(nan) == ddp::exact_text(nan));
  CHECK(ddp::exact_text(nan) != ddp::exact_text(-nan));  // a NaN shows its bits
  CHECK(ddp::exact_text(nan).rfind("nan(0x", 0) == 0);
}

TEST_CASE("sgd and adamw signatures: settings a digit apart differ, equal settings agree") {
  SUBCASE("sgd lr 1e-6 against 1.4e-6") {
    const ddp::sgd a{{.lr = 1e-6}}, b{{.lr = 1.4e-6}};
    CHECK(a.signature() != b.signature());
    CHECK(a.signature().find("lr=1e-06") != std::string::npos);
    CHECK(b.signature().find("lr=1.4e-06") != std::string::npos);
  }
  SUBCASE("sgd: each hyperparameter counts") {
    const ddp::sgd_options base{.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 1e-5};
    const std::string s = ddp::sgd{base}.signature();
    auto m = base;
    m.momentum = 0.9000001;
    CHECK(ddp::sgd{m}.signature() != s);
    m = base;
    m.dampening = 0.1000001;
    CHECK(ddp::sgd{m}.signature() != s);
    m = base;
    m.weight_decay = 1.000001e-5;
    CHECK(ddp::sgd{m}.signature() != s);
    m = base;
    m.nesterov = true;
    CHECK(ddp::sgd{m}.signature() != s);
  }
  SUBCASE("adamw eps 1e-8 against 1e-9, and each other hyperparameter") {
    const ddp::adamw a{{.eps = 1e-8}}, b{{.eps = 1e-9}};
    CHECK(a.signature() != b.signature());
    CHECK(a.signature().find("eps=1e-08") != std::string::npos);
    CHECK(b.signature().find("eps=1e-09") != std::string::npos);
    CHECK(ddp::adamw{{.lr = 1e-6}}.signature() != ddp::adamw{{.lr = 1.4e-6}}.signature());
    CHECK(ddp::adamw{{.beta2 = 0.999}}.signature() != ddp::adamw{{.beta2 = 0.9999}}.signature());
    CHECK(ddp::adamw{{.weight_decay = 1e-7}}.signature() != ddp::adamw{{.weight_decay = 2e-7}}.signature());
  }
  SUBCASE("equal settings, however reached, give equal signatures") {
    ddp::sgd a{{.lr = 0.1, .momentum = 0.9}}, b;
    b.options.lr = 0.1;
    b.options.momentum = 0.9;
    CHECK(a.signature() == b.signature());
    CHECK(ddp::adamw{}.signature() == ddp::adamw{{.lr = 1e-3, .eps = 1e-8}}.signature());
    CHECK(ddp::adamw{}.signature() == "adamw lr=0.001 betas=0.9,0.999 eps=1e-08 weight_decay=0.01");
    CHECK(ddp::sgd{}.signature() == "sgd lr=0.01 momentum=0 dampening=0 weight_decay=0 nesterov=0");
  }
}

TEST_CASE("a signature mismatch names both sides readably") {
  const std::vector<std::string> all = {ddp::sgd{{.lr = 1e-6}}.signature(), ddp::sgd{{.lr = 1.4e-6}}.signature()};
  const std::string msg = ddp::agreement::disagreement_text("the shard optimizer (its signature())", all, {1});
  CHECK(msg == "ranks disagree on the shard optimizer (its signature()): rank 0 has sgd lr=1e-06 momentum=0 "
               "dampening=0 weight_decay=0 nesterov=0; rank 1 has sgd lr=1.4e-06 momentum=0 dampening=0 "
               "weight_decay=0 nesterov=0");
}
