// The client's checks of the daemon's socket folder, socket and segments (see trust.h and expertd/trust.py).
#include "trust.h"

#include <pwd.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>

#include "expertd/errors.h"

namespace expertd::detail {

namespace {

const char* const kFix =
    "set $EXPERTD_DAEMON_UID to the daemon's user if it is the right daemon, else use a socket in a folder of your own";

std::mutex daemons_mutex;
std::set<uid_t> daemons;  // uids found behind trusted sockets

std::string named(uid_t uid) {
  passwd* pw = ::getpwuid(uid);
  std::string id = "uid " + std::to_string(uid);
  return pw != nullptr ? std::string(pw->pw_name) + " (" + id + ")" : id;
}

std::string describe(const std::string& path, const struct stat& st) {
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
  return path + " (owner " + named(st.st_uid) + ", mode " + mode + ")";
}

std::set<uid_t> trusted_uids() {
  std::set<uid_t> uids{0, ::geteuid()};
  {
    std::lock_guard<std::mutex> lock(daemons_mutex);
    uids.insert(daemons.begin(), daemons.end());
  }
  const char* env = std::getenv("EXPERTD_DAEMON_UID");
  std::string item;
  std::istringstream in(env != nullptr ? env : "");
  while (std::getline(in, item, ',')) {
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) item.pop_back();
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front()))) item.erase(0, 1);
    if (item.empty()) continue;
    if (item.find_first_not_of("0123456789") == std::string::npos) {
      uids.insert(static_cast<uid_t>(std::stoul(item)));
      continue;
    }
    passwd* pw = ::getpwnam(item.c_str());
    if (pw == nullptr) throw DaemonNotTrusted("$EXPERTD_DAEMON_UID names '" + item + "': no such user");
    uids.insert(pw->pw_uid);
  }
  return uids;
}

bool others_write(const struct stat& st) { return (st.st_mode & (S_IWGRP | S_IWOTH)) != 0; }

struct stat stat_of(const std::string& path, bool follow) {
  struct stat st {};
  if ((follow ? ::stat(path.c_str(), &st) : ::lstat(path.c_str(), &st)) != 0)
    throw DaemonNotTrusted("refusing to talk to the daemon: cannot stat " + path + ": " + std::strerror(errno));
  return st;
}

std::string dirname_of(const std::string& path) {
  std::size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

uid_t check_socket(const std::string& path) {
  char* real = ::realpath(dirname_of(path).c_str(), nullptr);
  if (real == nullptr) throw DaemonNotTrusted("refusing to talk to " + path + ": its folder cannot be resolved");
  std::string folder(real);
  std::free(real);
  std::string base = path.substr(path.find_last_of('/') + 1);
  std::set<uid_t> trusted = trusted_uids();
  struct stat st = stat_of(folder, true);
  struct stat sock = stat_of(folder + "/" + base, false);
  if (!S_ISSOCK(sock.st_mode)) throw DaemonNotTrusted("refusing to talk to " + path + ": " + describe(path, sock) + " is not a socket");
  bool ok;
  if (others_write(st)) {
    if ((st.st_mode & S_ISVTX) == 0)
      throw DaemonNotTrusted("refusing to talk to " + path + ": its folder " + describe(folder, st) +
                             " may be written by others, who could replace the socket; " + kFix);
    ok = trusted.count(sock.st_uid) != 0;  // sticky (like /tmp): anyone may have made the socket
  } else {
    struct stat parent = stat_of(dirname_of(folder), true);
    bool given = trusted.count(parent.st_uid) != 0 && !others_write(parent);
    ok = (trusted.count(st.st_uid) != 0 || given) && (trusted.count(sock.st_uid) != 0 || sock.st_uid == st.st_uid);
  }
  if (!ok)
    throw DaemonNotTrusted("refusing to talk to " + path + ": the socket " + describe(path, sock) + " in " +
                           describe(folder, st) + " belongs to a user this client does not trust (root, you, "
                           "$EXPERTD_DAEMON_UID); " + kFix);
  std::lock_guard<std::mutex> lock(daemons_mutex);
  daemons.insert(sock.st_uid);
  return sock.st_uid;
}

void check_owner(const std::string& path, const struct stat& st, const std::string& what) {
  if (trusted_uids().count(st.st_uid) == 0)
    throw DaemonNotTrusted("refusing to map " + what + " " + describe(path, st) + ": it belongs to neither the daemon "
                           "this client talks to nor a user it trusts; " + std::string(kFix));
}

}  // namespace expertd::detail
