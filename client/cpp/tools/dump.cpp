// expertd-cpp-dump ENDPOINT [--token T] [--json] [--views] [--timeout-ms N] [--bench N] [--hold-s S]
//                           [--refresh] [--server-key KEY] [--client-key FILE]
//
// Attach to a daemon with the C++ client and print, per served tensor (or with --views per checkpoint
// tensor), its name, dtype, shape, segment, offset and the xxh3 checksum computed over the mapped bytes (in
// the form the index records: "xxh3_64:" or the combined "xxh3_64x<n>:"), plus the generation; then release
// the lease. --bench N attaches N more times (lease + index + tensors + release) and reports each timing.
// --hold-s S holds the lease S seconds first (the heartbeat thread keeps it) and reports whether the daemon
// still lists it. --refresh then moves to the latest generation and dumps that one (reporting what changed,
// and whether the views taken before kept their bytes). With --json it also reports the leases the daemon
// lists right after the release.
// Exit status: 0 ok, 2 usage, 3 DaemonNotRunning, 4 DaemonTimeout, 5 AuthError, 6 another DaemonError,
// 7 ProtocolError / CorruptIndex, 8 ShmError, 1 anything else; the error's type leads its message on stderr.
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "expertd/client.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

const char* torch_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat8_e4m3fn: return "torch.float8_e4m3fn";
    case at::kFloat8_e5m2: return "torch.float8_e5m2";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    default: return "unknown";
  }
}

int usage(const char* why) {
  std::fprintf(stderr,
               "expertd-cpp-dump: %s\nusage: expertd-cpp-dump ENDPOINT [--token T] [--json] [--views] [--timeout-ms N] "
               "[--bench N] [--hold-s S] [--refresh] [--server-key KEY] [--client-key FILE]\n",
               why);
  return 2;
}

struct Row {
  std::string name, dtype, segment, checksum, recorded, whole;
  std::vector<int64_t> shape;
  uint64_t offset = 0, nbytes = 0;
};

std::string shape_json(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int run(int argc, char** argv) {
  std::string endpoint;
  expertd::Options options;
  bool json = false, views = false;
  int bench = 0;
  double hold_s = 0;
  bool refresh = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* flag) -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(std::string(flag) + " needs a value");
      return argv[++i];
    };
    if (a == "--token") options.token = value("--token");
    else if (a == "--json") json = true;
    else if (a == "--views") views = true;
    else if (a == "--timeout-ms") options.timeout_ms = std::stoi(value("--timeout-ms"));
    else if (a == "--bench") bench = std::stoi(value("--bench"));
    else if (a == "--hold-s") hold_s = std::stod(value("--hold-s"));
    else if (a == "--refresh") refresh = true;
    else if (a == "--server-key") options.server_key = value("--server-key");
    else if (a == "--client-key") options.client_key = value("--client-key");
    else if (a == "-h" || a == "--help") return usage("attach to an expertd daemon and dump what it serves"), 0;
    else if (!a.empty() && a[0] == '-') return usage(("unknown option " + a).c_str());
    else if (endpoint.empty()) endpoint = a;
    else return usage("more than one ENDPOINT");
  }
  if (endpoint.empty()) return usage("no ENDPOINT");

  auto t0 = Clock::now();
  expertd::Client client(endpoint, options);
  double lease_ms = ms_since(t0);
  t0 = Clock::now();
  std::shared_ptr<const expertd::Index> index = client.index();
  double index_ms = ms_since(t0);
  t0 = Clock::now();
  std::map<std::string, at::Tensor> tensors = views ? client.tensors() : client.served_tensors();
  double tensors_ms = ms_since(t0);

  std::string lease = client.lease();
  auto lease_ids = [](const expertd::Value& status) {
    std::vector<std::string> ids;
    if (const expertd::Value* leases = status.get("leases"))
      for (const auto& l : leases->as_array()) ids.push_back(l.get("client")->as_str());
    return ids;
  };
  std::string held, refreshed;
  if (hold_s > 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(hold_s));
    auto ids = lease_ids(client.status());
    bool alive = std::find(ids.begin(), ids.end(), client.lease()) != ids.end();
    held = ", \"held\": {\"seconds\": " + std::to_string(hold_s) + ", \"lease_alive\": " + (alive ? "true" : "false") +
           ", \"lease\": " + expertd::to_json(client.lease()) +
           ", \"heartbeat_error\": " + expertd::to_json(client.last_heartbeat_error()) + "}";
    if (!json) std::printf("held %.1f s: lease %s %s\n", hold_s, client.lease().c_str(), alive ? "alive" : "gone");
  }
  if (refresh) {  // move to the latest generation; the views taken before must stay as they were
    int64_t seen = client.latest_generation();
    std::vector<std::pair<at::Tensor, std::string>> before;
    for (const auto& [name, t] : tensors) before.emplace_back(t, expertd::tensor_checksum(t.data_ptr(), t.nbytes()));
    expertd::Value::Array changed;
    for (auto& name : client.refresh()) changed.emplace_back(name);
    bool unchanged = true;
    for (const auto& [t, sum] : before) unchanged = unchanged && expertd::tensor_checksum(t.data_ptr(), t.nbytes()) == sum;
    index = client.index();
    tensors = views ? client.tensors() : client.served_tensors();
    refreshed = ", \"refresh\": {\"latest_seen\": " + std::to_string(seen) + ", \"changed\": " +
                expertd::to_json(expertd::Value(changed)) + ", \"old_views_unchanged\": " + (unchanged ? "true" : "false") + "}";
    if (!json) std::printf("refreshed to generation %" PRId64 ": %zu tensor(s) changed\n", index->generation, changed.size());
  }

  std::vector<Row> rows;
  auto add = [&](const expertd::TensorEntry& e, const at::Tensor& t) {
    Row r;
    r.name = e.name;
    r.dtype = torch_name(t.scalar_type());
    r.shape = t.sizes().vec();
    r.segment = e.segment;
    r.offset = e.offset;
    r.nbytes = t.nbytes();
    const void* data = t.nbytes() ? t.data_ptr() : nullptr;
    r.recorded = e.checksum.value_or("");
    r.checksum = expertd::tensor_checksum(data, t.nbytes(), e.checksum ? expertd::checksum_parts(*e.checksum) : 1);
    r.whole = expertd::tensor_checksum(data, t.nbytes(), 1);
    rows.push_back(std::move(r));
  };
  if (views) {
    for (const auto& [name, entry] : index->checkpoint_entries()) add(entry, tensors.at(name));
  } else {
    for (const auto& entry : index->tensors) add(entry, tensors.at(entry.name));
  }
  int64_t generation = index->generation;
  tensors.clear();
  t0 = Clock::now();
  client.close();
  double close_ms = ms_since(t0);
  int64_t latest = client.latest_generation();
  std::string after;
  if (json) {  // asked while this process lives: a lease the daemon drops only when its process goes would show
    expertd::Connection conn(expertd::make_context(), endpoint, options.timeout_ms,
                             expertd::Credentials::resolve(options.token, options.server_key, options.client_key));
    expertd::Value::Array ids;
    for (auto& id : lease_ids(conn.request("status"))) ids.emplace_back(id);
    after = ", \"leases_after_close\": " + expertd::to_json(expertd::Value(ids));
  }

  std::vector<std::vector<double>> runs;  // lease, index, served tensors, close
  for (int k = 0; k < bench; ++k) {
    auto a = Clock::now();
    expertd::Client c(endpoint, options);
    double l = ms_since(a);
    auto b = Clock::now();
    c.index();
    double x = ms_since(b);
    b = Clock::now();
    auto ts = views ? c.tensors() : c.served_tensors();
    double t = ms_since(b);
    b = Clock::now();
    c.close();
    runs.push_back({l, x, t, ms_since(b)});
  }

  if (json) {
    std::string out = "{\"endpoint\": " + expertd::to_json(endpoint) + ", \"lease\": " + expertd::to_json(lease) +
                      ", \"generation\": " + std::to_string(generation) + ", \"latest\": " + std::to_string(latest) +
                      ", \"tensors\": [";
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      out += std::string(i ? ", " : "") + "{\"name\": " + expertd::to_json(r.name) + ", \"dtype\": \"" + r.dtype +
             "\", \"shape\": " + shape_json(r.shape) + ", \"segment\": " + expertd::to_json(r.segment) +
             ", \"offset\": " + std::to_string(r.offset) + ", \"nbytes\": " + std::to_string(r.nbytes) +
             ", \"checksum\": \"" + r.checksum + "\", \"recorded\": " +
             (r.recorded.empty() ? std::string("null") : "\"" + r.recorded + "\"") + ", \"xxh3_64\": \"" + r.whole + "\"}";
    }
    char buf[256];
    std::snprintf(buf, sizeof buf, "], \"timings_ms\": {\"lease\": %.3f, \"index\": %.3f, \"tensors\": %.3f, \"close\": %.3f}",
                  lease_ms, index_ms, tensors_ms, close_ms);
    out += buf;
    out += ", \"bench_ms\": [";
    for (std::size_t i = 0; i < runs.size(); ++i) {
      std::snprintf(buf, sizeof buf, "%s{\"lease\": %.3f, \"index\": %.3f, \"tensors\": %.3f, \"close\": %.3f}", i ? ", " : "",
                    runs[i][0], runs[i][1], runs[i][2], runs[i][3]);
      out += buf;
    }
    out += "]" + held + refreshed + after + "}";
    std::cout << out << std::endl;
  } else {
    std::printf("generation %" PRId64 " (lease %s, latest %" PRId64 ", %zu %s tensors)\n", generation, lease.c_str(), latest,
                rows.size(), views ? "checkpoint" : "served");
    for (const Row& r : rows)
      std::printf("%s\t%s\t%s\t%s\t%" PRIu64 "\t%s\n", r.name.c_str(), r.dtype.c_str(), shape_json(r.shape).c_str(),
                  r.segment.c_str(), r.offset, r.checksum.c_str());
    std::printf("attach: lease %.2f ms, index %.2f ms, tensors %.2f ms\n", lease_ms, index_ms, tensors_ms);
    for (const auto& r : runs)
      std::printf("bench: lease %.2f ms, index %.2f ms, tensors %.2f ms, close %.2f ms (attach %.2f ms)\n", r[0], r[1], r[2],
                  r[3], r[0] + r[1] + r[2]);
  }
  return 0;
}

int fail(int code, const char* type, const std::exception& exc) {
  std::fprintf(stderr, "expertd-cpp-dump: %s: %s\n", type, exc.what());
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const expertd::DaemonNotRunning& e) {
    return fail(3, "DaemonNotRunning", e);
  } catch (const expertd::DaemonTimeout& e) {
    return fail(4, "DaemonTimeout", e);
  } catch (const expertd::AuthError& e) {
    return fail(5, "AuthError", e);
  } catch (const expertd::DaemonError& e) {
    return fail(6, e.kind().c_str(), e);
  } catch (const expertd::CorruptIndex& e) {
    return fail(7, "CorruptIndex", e);
  } catch (const expertd::ProtocolError& e) {
    return fail(7, "ProtocolError", e);
  } catch (const expertd::ShmError& e) {
    return fail(8, "ShmError", e);
  } catch (const std::invalid_argument& e) {
    return usage(e.what());
  } catch (const std::exception& e) {
    return fail(1, "Error", e);
  }
}
