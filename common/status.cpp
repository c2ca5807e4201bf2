#include "membar/status.h"

namespace membar {

std::string_view status_code_name(StatusCode code) {
  switch (code) {
#define MEMBAR_STATUS_NAME(name, number, text) \
  case StatusCode::name:                       \
    return #name;
    MEMBAR_STATUS_CODES(MEMBAR_STATUS_NAME)
#undef MEMBAR_STATUS_NAME
  }
  return "UNKNOWN_CODE";
}

std::string_view status_code_description(StatusCode code) {
  switch (code) {
#define MEMBAR_STATUS_TEXT(name, number, text) \
  case StatusCode::name:                       \
    return text;
    MEMBAR_STATUS_CODES(MEMBAR_STATUS_TEXT)
#undef MEMBAR_STATUS_TEXT
  }
  return "unknown status code";
}

bool status_code_is_known(int32_t number) {
  switch (number) {
#define MEMBAR_STATUS_KNOWN(name, value, text) case value:
    MEMBAR_STATUS_CODES(MEMBAR_STATUS_KNOWN)
#undef MEMBAR_STATUS_KNOWN
    return true;
  }
  return false;
}

std::string Status::to_string() const {
  std::string out(status_code_name(code_));
  if (!message_.empty()) {
    out += ": ";
    out += message_;
  }
  return out;
}

}  // namespace membar
