// The status table feeds the wire, the logs and the CLI: names, numbers and Result must agree.
#include <gtest/gtest.h>

#include <string>

#include "membar/status.h"

namespace membar {
namespace {

TEST(StatusTest, NamesAndNumbersComeFromOneTable) {
  EXPECT_EQ(status_code_name(StatusCode::RESOURCE_EXHAUSTED), "RESOURCE_EXHAUSTED");
  EXPECT_EQ(static_cast<int>(StatusCode::RESOURCE_EXHAUSTED), 8);
  EXPECT_EQ(static_cast<int>(StatusCode::UNAVAILABLE), 14);
  for (int number = 0; number <= 16; ++number) {
    EXPECT_TRUE(status_code_is_known(number)) << number;
    EXPECT_NE(status_code_name(static_cast<StatusCode>(number)), "UNKNOWN_CODE") << number;
  }
  EXPECT_FALSE(status_code_is_known(-1));
  EXPECT_FALSE(status_code_is_known(17));
  EXPECT_EQ(status_code_name(static_cast<StatusCode>(1234)), "UNKNOWN_CODE");
}

TEST(StatusTest, ToStringCarriesCodeAndMessage) {
  Status s = resource_exhausted("client 3 is over its GPU quota");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.to_string(), "RESOURCE_EXHAUSTED: client 3 is over its GPU quota");
  EXPECT_EQ(Status::Ok().to_string(), "OK");
}

Result<int> half_of(int x) {
  if (x % 2 != 0) return invalid_argument("odd: " + std::to_string(x));
  return x / 2;
}

Status quarter_of(int x, int* out) {
  MEMBAR_ASSIGN_OR_RETURN(int half, half_of(x));
  MEMBAR_ASSIGN_OR_RETURN(int quarter, half_of(half));
  *out = quarter;
  return Status::Ok();
}

TEST(StatusTest, ResultAndMacrosPropagateErrors) {
  int out = -1;
  EXPECT_TRUE(quarter_of(8, &out).ok());
  EXPECT_EQ(out, 2);
  Status s = quarter_of(6, &out);
  EXPECT_EQ(s.code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.message(), "odd: 3");
  Result<int> r = half_of(5);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::INVALID_ARGUMENT);
}

}  // namespace
}  // namespace membar
