// connect(): which runtime a trainer gets. See membar/client.h.
//   1. ConnectOptions::socket_path, when given: that daemon, or its error.
//   2. $MEMBAR_SOCKET, when set: that daemon, or its error ("embedded" forces embedded mode).
//   3. The default socket (/run/membar/membard.sock), when a daemon answers there.
//   4. An embedded runtime, when allow_embedded; UNAVAILABLE otherwise.
// An explicitly named daemon that does not answer is an error, never a silent fall back to
// embedded mode: a trainer sized for a shared node must not quietly run alone.
#include <sys/stat.h>

#include <cstdlib>

#include "membar/client.h"

namespace membar {

Result<std::unique_ptr<Client>> connect(const ConnectOptions& options) {
  if (!options.socket_path.empty()) return connect_daemon(options.socket_path, options);
  const char* from_environment = std::getenv("MEMBAR_SOCKET");
  if (from_environment != nullptr && *from_environment != 0) {
    std::string path(from_environment);
    if (path == "embedded") return make_embedded_client(options.embedded);
    return connect_daemon(path, options);
  }
  struct stat default_socket {};
  Status daemon_status = unavailable(std::string("no membard socket at ") + kDefaultSocketPath);
  if (::stat(kDefaultSocketPath, &default_socket) == 0 && S_ISSOCK(default_socket.st_mode)) {
    Result<std::unique_ptr<Client>> daemon = connect_daemon(kDefaultSocketPath, options);
    if (daemon.ok()) return daemon;
    daemon_status = daemon.status();
  }
  if (!options.allow_embedded) {
    return unavailable("no daemon reachable (" + daemon_status.message() +
                       ") and ConnectOptions::allow_embedded is false");
  }
  return make_embedded_client(options.embedded);
}

}  // namespace membar
