// The daemon client: membar::Client over a membard's control socket and shared-memory rings
// (protocol v1). connect() (connect.cpp) uses it; tests may call it directly.
#pragma once

#include <memory>
#include <string>

#include "membar/client.h"

namespace membar {

// Connects to the membard at `socket_path` and completes the handshake. UNAVAILABLE when no
// daemon answers there; the daemon's own error (PERMISSION_DENIED, FAILED_PRECONDITION for a
// protocol version mismatch, RESOURCE_EXHAUSTED ...) when it refuses. Blocks (bounded: 5 s).
//
// Timeouts (environment, milliseconds): MEMBAR_CALL_TIMEOUT_MS (default 30000) bounds every
// request's round trip, MEMBAR_WAIT_TIMEOUT_MS (default 120000) bounds wait(ticket). A call
// never hangs on a dead daemon: it returns UNAVAILABLE within a few milliseconds of the
// daemon's socket closing, and every later call returns UNAVAILABLE too.
Result<std::unique_ptr<Client>> connect_daemon(const std::string& socket_path, const ConnectOptions& options);

// One empty round trip through the client's rings (the daemon answers without the engine): the
// request-latency benchmark's unit. INVALID_ARGUMENT when `client` is not a daemon client.
Status daemon_client_nop(Client& client);

}  // namespace membar
