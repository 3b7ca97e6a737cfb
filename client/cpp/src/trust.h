// Whom the client trusts before it sends a token or maps a byte (expertd/trust.py, the same rules): the socket's
// path is walked from / one component at a time; a link on it must be a trusted uid's; every folder writable by its
// owner only (a sticky one of a trusted uid aside, on the way, never as the socket's own folder), owned by root, this
// uid, a uid of $EXPERTD_DAEMON_UID or the one owner a folder only those may write gave it to; the socket a socket of
// the folder's owner. Its owner is then a daemon of this process: segments of it may be mapped.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <string>

namespace expertd::detail {

// The daemon's uid behind ipc socket `path`; DaemonNotTrusted (one line: path, owner, mode) otherwise.
uid_t check_socket(const std::string& path);

// DaemonNotTrusted unless `st` (of `path`, a segment) belongs to a trusted uid or a daemon found by check_socket.
void check_owner(const std::string& path, const struct stat& st, const std::string& what);

}  // namespace expertd::detail
