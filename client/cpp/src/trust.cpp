// The client's checks of the daemon's socket folder, socket and segments (see trust.h and expertd/trust.py).
#include "trust.h"

#include <pwd.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <set>
#include <sstream>
#include <vector>

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

std::string dirname_of(const std::string& path) {
  std::size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

DaemonNotTrusted refuse(const std::string& path, const std::string& why) {
  return DaemonNotTrusted("refusing to talk to " + path + ": " + why + "; " + kFix);
}

struct Entry {
  std::string path;
  struct stat st;
};

// Resolve the absolute `path` one component at a time, as the kernel would, never trusting its resolution: the
// folders met on the way (a link is followed only when a trusted uid owns it) and, last, the entry `path` names.
std::vector<Entry> walk(const std::string& path, const std::set<uid_t>& trusted) {
  std::vector<Entry> met;
  std::deque<std::string> todo;
  auto push_parts = [&todo](const std::string& text) {
    std::deque<std::string> parts;
    std::string part;
    std::istringstream in(text);
    while (std::getline(in, part, '/'))
      if (!part.empty() && part != ".") parts.push_back(part);
    todo.insert(todo.begin(), parts.begin(), parts.end());
  };
  auto lstat_of = [&path](const std::string& entry) {
    struct stat st {};
    if (::lstat(entry.c_str(), &st) != 0)
      throw refuse(path, "its path cannot be followed at " + entry + " (" + std::strerror(errno) + ")");
    return st;
  };
  std::string current = "/";
  met.push_back({current, lstat_of(current)});
  push_parts(path);
  int links = 0;
  while (!todo.empty()) {
    std::string name = todo.front();
    todo.pop_front();
    if (name == "..") {  // `current` is resolved already: its parent is its real parent
      current = dirname_of(current);
      continue;
    }
    std::string entry = (current == "/" ? "" : current) + "/" + name;
    struct stat st = lstat_of(entry);
    if (S_ISLNK(st.st_mode)) {
      if (trusted.count(st.st_uid) == 0)
        throw refuse(path, "the symbolic link " + describe(entry, st) + " on its way belongs to a user this client "
                     "does not trust, who could point it at a daemon of their own");
      if (++links > 40) throw refuse(path, "its path has too many symbolic links");
      std::vector<char> buf(4096);
      ssize_t n = ::readlink(entry.c_str(), buf.data(), buf.size() - 1);
      if (n < 0) throw refuse(path, "cannot read the link " + entry);
      std::string target(buf.data(), static_cast<std::size_t>(n));
      push_parts(target);
      if (!target.empty() && target[0] == '/') current = "/";
      continue;
    }
    if (!S_ISDIR(st.st_mode)) {
      if (!todo.empty()) throw refuse(path, entry + " on its way is not a folder");
      met.push_back({entry, st});
      return met;
    }
    met.push_back({entry, st});
    current = entry;
  }
  throw refuse(path, "it is a folder, not a socket");
}

}  // namespace

uid_t check_socket(const std::string& path) {
  std::set<uid_t> trusted = trusted_uids();
  std::vector<Entry> met = walk(path, trusted);
  const Entry sock = met.back();
  met.pop_back();
  if (!S_ISSOCK(sock.st.st_mode))
    throw DaemonNotTrusted("refusing to talk to " + path + ": " + describe(sock.path, sock.st) + " is not a socket");
  std::set<uid_t> owners = trusted;
  bool given = false;
  const struct stat* parent = nullptr;
  for (std::size_t k = 0; k < met.size(); ++k) {
    const Entry& f = met[k];
    bool own = k + 1 == met.size();  // the socket's own folder
    if (others_write(f.st) && (own || (f.st.st_mode & S_ISVTX) == 0 || trusted.count(f.st.st_uid) == 0))
      throw refuse(path, std::string(own ? "its" : "the") + " folder " + describe(f.path, f.st) +
                   " may be written by others, who could replace " + (own ? "the socket" : "what lies below it"));
    if (owners.count(f.st.st_uid) == 0) {
      if (given || parent == nullptr || trusted.count(parent->st_uid) == 0 || others_write(*parent))
        throw refuse(path, "the folder " + describe(f.path, f.st) + " belongs to a user this client does not trust "
                     "(root, you, $EXPERTD_DAEMON_UID), not given to it in a folder only they may write");
      given = true;  // root (or a trusted uid) made it theirs: the daemon's user
      owners.insert(f.st.st_uid);
    }
    parent = &f.st;
  }
  const Entry& folder = met.back();
  if (sock.st.st_uid != folder.st.st_uid && !(trusted.count(sock.st.st_uid) && trusted.count(folder.st.st_uid)))
    throw refuse(path, "the socket " + describe(sock.path, sock.st) + " in " + describe(folder.path, folder.st) +
                 " belongs to neither the folder's owner nor a user this client trusts (root, you, "
                 "$EXPERTD_DAEMON_UID)");
  std::lock_guard<std::mutex> lock(daemons_mutex);
  daemons.insert(sock.st.st_uid);
  return sock.st.st_uid;
}

void check_owner(const std::string& path, const struct stat& st, const std::string& what) {
  if (trusted_uids().count(st.st_uid) == 0)
    throw DaemonNotTrusted("refusing to map " + what + " " + describe(path, st) + ": it belongs to neither the daemon "
                           "this client talks to nor a user it trusts; " + std::string(kFix));
}

}  // namespace expertd::detail
