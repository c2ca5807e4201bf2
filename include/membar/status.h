// Status codes and Result<T> shared by the daemon, the client library, the wire protocol,
// the logs and the CLI. One table (MEMBAR_STATUS_CODES) feeds all of them, as libuv's
// UV_ERRNO_MAP does. Codes follow abseil's canonical set; their numeric values travel on the
// wire, so an existing code never changes its number (append new ones).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace membar {

// X(name, number, short description)
#define MEMBAR_STATUS_CODES(X)                                                              \
  X(OK, 0, "ok")                                                                            \
  X(CANCELLED, 1, "the operation was cancelled")                                            \
  X(UNKNOWN, 2, "unknown error")                                                            \
  X(INVALID_ARGUMENT, 3, "invalid argument")                                                \
  X(DEADLINE_EXCEEDED, 4, "deadline exceeded")                                              \
  X(NOT_FOUND, 5, "not found")                                                              \
  X(ALREADY_EXISTS, 6, "already exists")                                                    \
  X(PERMISSION_DENIED, 7, "permission denied")                                              \
  X(RESOURCE_EXHAUSTED, 8, "resource exhausted (out of frames or over quota)")              \
  X(FAILED_PRECONDITION, 9, "failed precondition")                                          \
  X(ABORTED, 10, "aborted")                                                                 \
  X(OUT_OF_RANGE, 11, "out of range")                                                       \
  X(UNIMPLEMENTED, 12, "unimplemented")                                                     \
  X(INTERNAL, 13, "internal error")                                                         \
  X(UNAVAILABLE, 14, "unavailable (retry the call, or the daemon is gone)")                 \
  X(DATA_LOSS, 15, "data loss")                                                             \
  X(UNAUTHENTICATED, 16, "unauthenticated")

enum class StatusCode : int32_t {
#define MEMBAR_STATUS_ENUM(name, number, text) name = number,
  MEMBAR_STATUS_CODES(MEMBAR_STATUS_ENUM)
#undef MEMBAR_STATUS_ENUM
};

// "RESOURCE_EXHAUSTED"; "UNKNOWN_CODE" for a number outside the table.
std::string_view status_code_name(StatusCode code);
// The table's short description.
std::string_view status_code_description(StatusCode code);
// True when `number` is in the table (wire input is checked with this before a cast).
bool status_code_is_known(int32_t number);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::OK; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "RESOURCE_EXHAUSTED: client 3 is over its GPU quota (...)"
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::OK;
  std::string message_;
};

inline Status invalid_argument(std::string m) { return {StatusCode::INVALID_ARGUMENT, std::move(m)}; }
inline Status not_found(std::string m) { return {StatusCode::NOT_FOUND, std::move(m)}; }
inline Status already_exists(std::string m) { return {StatusCode::ALREADY_EXISTS, std::move(m)}; }
inline Status out_of_range(std::string m) { return {StatusCode::OUT_OF_RANGE, std::move(m)}; }
inline Status resource_exhausted(std::string m) { return {StatusCode::RESOURCE_EXHAUSTED, std::move(m)}; }
inline Status failed_precondition(std::string m) { return {StatusCode::FAILED_PRECONDITION, std::move(m)}; }
inline Status permission_denied(std::string m) { return {StatusCode::PERMISSION_DENIED, std::move(m)}; }
inline Status unavailable(std::string m) { return {StatusCode::UNAVAILABLE, std::move(m)}; }
inline Status internal_error(std::string m) { return {StatusCode::INTERNAL, std::move(m)}; }
inline Status unimplemented(std::string m) { return {StatusCode::UNIMPLEMENTED, std::move(m)}; }
inline Status aborted(std::string m) { return {StatusCode::ABORTED, std::move(m)}; }
inline Status deadline_exceeded(std::string m) { return {StatusCode::DEADLINE_EXCEEDED, std::move(m)}; }

// A value or a non-OK Status. No exceptions: callers test ok() and take value() or status().
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : storage_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : storage_(std::move(status)) {}  // NOLINT(google-explicit-constructor)

  bool ok() const { return std::holds_alternative<T>(storage_); }
  // Precondition: ok().
  T& value() & { return std::get<T>(storage_); }
  const T& value() const& { return std::get<T>(storage_); }
  T&& value() && { return std::get<T>(std::move(storage_)); }
  // OK when a value is held.
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(storage_); }

 private:
  std::variant<T, Status> storage_;
};

}  // namespace membar

// Returns early from a function returning Status or Result<T> when `expr` is not OK.
#define MEMBAR_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::membar::Status membar_status_ = (expr);        \
    if (!membar_status_.ok()) return membar_status_; \
  } while (0)

#define MEMBAR_CONCAT_INNER(a, b) a##b
#define MEMBAR_CONCAT(a, b) MEMBAR_CONCAT_INNER(a, b)
// MEMBAR_ASSIGN_OR_RETURN(auto x, make_x()); returns the Status when make_x() fails.
#define MEMBAR_ASSIGN_OR_RETURN(lhs, expr)                                    \
  auto MEMBAR_CONCAT(membar_result_, __LINE__) = (expr);                      \
  if (!MEMBAR_CONCAT(membar_result_, __LINE__).ok())                          \
    return MEMBAR_CONCAT(membar_result_, __LINE__).status();                  \
  lhs = std::move(MEMBAR_CONCAT(membar_result_, __LINE__)).value()
