// The schema-2 tensor index (PROTOCOL.md §5): parsing and checking it, the derived views, checkpoint names.
#include "expertd/tensor_index.h"

#include <algorithm>
#include <tuple>

#include "detail.h"
#include "expertd/errors.h"

namespace expertd {

using detail::quote;
using detail::shape_text;

std::vector<std::string> decode_sources(const Value& value) {
  std::vector<std::string> out;
  if (value.is_array()) {
    for (const auto& s : value.as_array()) out.push_back(s.as_str("a tensor's source"));
    return out;
  }
  if (!value.is_map())
    throw ProtocolError(std::string("sources must be a list or a pattern, got ") + type_name(value.type()));
  const Value *prefix = value.get("prefix"), *experts = value.get("experts"), *parts = value.get("parts");
  bool ok = prefix && prefix->is_str() && parts && parts->is_array() && !parts->as_array().empty() && experts &&
            experts->is_array() && experts->as_array().size() == 2;
  if (ok)
    for (const auto& p : parts->as_array()) ok = ok && p.is_str();
  if (ok)
    for (const auto& n : experts->as_array()) ok = ok && n.is_int() && !n.is_negative();
  if (ok) ok = experts->as_array()[1].as_uint() >= 1;
  if (!ok) throw ProtocolError("malformed sources pattern " + to_json(value));
  uint64_t first = experts->as_array()[0].as_uint(), count = experts->as_array()[1].as_uint();
  out.reserve(count * parts->as_array().size());
  for (uint64_t e = first; e < first + count; ++e)
    for (const auto& p : parts->as_array()) out.push_back(prefix->as_str() + std::to_string(e) + p.as_str());
  return out;
}

namespace {

const std::vector<std::string> ENTRY_FIELDS = {"name", "segment", "offset", "nbytes", "shape", "dtype",
                                               "sources", "base", "checksum", "experts", "extents"};

std::optional<ExpertBlock> expert_block(const Value* v) {
  if (v == nullptr || v->is_nil()) return std::nullopt;
  ExpertBlock b;
  try {
    const Value* total = v->get("total");
    const Value* ranges = v->get("ranges");
    if (!total || !ranges) throw ProtocolError("needs total and ranges");
    b.total = total->as_int("total");
    for (const auto& r : ranges->as_array("ranges")) {
      const auto& pair = r.as_array("a range");
      if (pair.size() != 2) throw ProtocolError("a range is [first, count]");
      b.ranges.emplace_back(pair[0].as_int("first"), pair[1].as_int("count"));
    }
  } catch (const ProtocolError& exc) {
    throw ProtocolError("malformed expert block " + to_json(*v) + ": " + exc.what());
  }
  for (auto [a, n] : b.ranges)
    if (a < 0 || n < 1 || a + n > b.total)
      throw ProtocolError("malformed expert block " + to_json(*v) + ": ranges must lie within " +
                          std::to_string(b.total) + " experts");
  return b;
}

std::string extent_text(const Extent& e) {
  return "(" + e.segment + ", " + std::to_string(e.offset) + ", " + std::to_string(e.nbytes) + ")";
}

// Refuse extents of which two hold the same byte of a segment (Python's expertd.extents.disjoint): the daemon writes
// each byte of a tensor once, and one segment's pages mapped again and again would make a view of any size.
void check_disjoint(const std::vector<Extent>& extents, const std::string& name) {
  std::vector<std::size_t> order(extents.size());
  for (std::size_t k = 0; k < order.size(); ++k) order[k] = k;
  auto span = [&](std::size_t k) {
    const Extent& e = extents[k];
    return std::tuple<const std::string&, uint64_t, uint64_t, std::size_t>(e.segment, e.offset, e.offset + e.nbytes, k);
  };
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return span(a) < span(b); });
  for (std::size_t k = 1; k < order.size(); ++k) {  // sorted: an overlap is between neighbours
    const Extent &p = extents[order[k - 1]], &q = extents[order[k]];
    if (p.segment != q.segment || q.offset >= p.offset + p.nbytes) continue;
    const Extent &a = extents[std::min(order[k - 1], order[k])], &b = extents[std::max(order[k - 1], order[k])];
    throw ProtocolError("tensor index: " + name + "'s extents " + extent_text(a) + " and " + extent_text(b) +
                        " overlap: both hold bytes [" + std::to_string(q.offset) + ", " +
                        std::to_string(std::min(p.offset + p.nbytes, q.offset + q.nbytes)) + ") of segment " +
                        p.segment + "; no byte may lie in two extents of a tensor");
  }
}

// An entry's extents, checked before anything is mapped (Python's expertd.extents.from_wire): at least two and at
// most MAX_EXTENTS, at most MAX_INDEX_EXTENTS with the `held` of the entries read before it (counted in), each
// [segment, offset, nbytes > 0], none sharing a byte of a segment, summing to the entry's nbytes.
std::vector<Extent> extents_of(const Value& v, const std::string& name, uint64_t nbytes, std::size_t& held) {
  std::vector<Extent> out;
  uint64_t total = 0;
  const auto& items = v.as_array("a tensor's extents");
  if (items.size() < 2)
    throw ProtocolError("tensor index: " + name + "'s extents must be a list of at least two [segment, offset, nbytes]");
  if (items.size() > MAX_EXTENTS)
    throw ProtocolError("tensor index: " + name + " has " + std::to_string(items.size()) + " extents, more than the " +
                        std::to_string(MAX_EXTENTS) + " a daemon serves a tensor in (it writes a stack of more ranges "
                        "whole again)");
  if (held + items.size() > MAX_INDEX_EXTENTS)
    throw ProtocolError("tensor index: " + name + "'s " + std::to_string(items.size()) + " extents make the index's " +
                        std::to_string(held + items.size()) + ", more than the " + std::to_string(MAX_INDEX_EXTENTS) +
                        " a reader maps for one index");
  for (const auto& item : items) {
    const auto& triple = item.as_array("an extent");
    if (triple.size() != 3 || !triple[0].is_str() || !triple[1].is_int() || triple[1].is_negative() ||
        !triple[2].is_int() || triple[2].is_negative() || triple[2].as_uint() == 0)
      throw ProtocolError("tensor index: " + name + "'s extent " + to_json(item) + " is not [segment, offset, nbytes > 0]");
    out.push_back({triple[0].as_str(), triple[1].as_uint(), triple[2].as_uint()});
    if (total + out.back().nbytes < total || out.back().offset + out.back().nbytes < out.back().offset)
      throw ProtocolError("tensor index: " + name + "'s extents overflow");
    total += out.back().nbytes;
  }
  check_disjoint(out, name);
  if (total != nbytes)
    throw ProtocolError("tensor index: " + name + "'s extents hold " + std::to_string(total) + " bytes, not its " +
                        std::to_string(nbytes));
  held += out.size();
  return out;
}

TensorEntry tensor_entry(const Value& t, bool decode_pattern, std::size_t& held) {
  const auto& m = t.as_map("a tensor entry");
  for (const auto& [k, _] : m) {
    bool known = false;
    for (const auto& f : ENTRY_FIELDS) known = known || f == k;
    if (!known) throw ProtocolError("tensor entry has an unexpected field " + quote(k));
  }
  auto need = [&](const char* key) -> const Value& {
    const Value* v = t.get(key);
    if (v == nullptr) throw ProtocolError(std::string("tensor entry lacks ") + quote(key));
    return *v;
  };
  TensorEntry e;
  e.name = need("name").as_str("a tensor's name");
  e.segment = need("segment").as_str("a tensor's segment");
  e.offset = need("offset").as_uint("a tensor's offset");
  e.nbytes = need("nbytes").as_uint("a tensor's nbytes");
  for (const auto& d : need("shape").as_array("a tensor's shape")) {
    if (!d.is_int() || d.is_negative()) throw ProtocolError("a tensor's shape must hold non-negative integers");
    e.shape.push_back(d.as_int());
  }
  e.dtype = need("dtype").as_str("a tensor's dtype");
  if (const Value* s = t.get("sources")) {
    if (decode_pattern || s->is_array()) e.sources = decode_sources(*s);
    else throw ProtocolError("a view's sources must be a list");
  }
  if (const Value* b = t.get("base"); b && !b->is_nil()) e.base = b->as_str("a tensor's base");
  if (const Value* c = t.get("checksum"); c && !c->is_nil()) e.checksum = c->as_str("a tensor's checksum");
  e.experts = expert_block(t.get("experts"));
  if (const Value* x = t.get("extents"); x && !x->is_nil()) e.extents = extents_of(*x, e.name, e.nbytes, held);
  return e;
}

}  // namespace

Index index_from_value(const Value& data) {
  if (!data.is_map()) throw ProtocolError(std::string("tensor index must be a mapping, got ") + type_name(data.type()));
  const Value* schema = data.get("schema");
  if (!schema || !schema->is_int() || schema->is_negative() || schema->as_uint() < 1 || schema->as_uint() > 3)
    throw ProtocolError("tensor index schema " + (schema ? to_json(*schema) : std::string("None")) +
                        " is not supported (this expertd reads 1, 2, 3)");
  Index index;
  index.schema = static_cast<int>(schema->as_uint());
  std::size_t held = 0;  // the extents of the entries read so far (MAX_INDEX_EXTENTS bounds them)
  try {
    auto need = [&](const char* key) -> const Value& {
      const Value* v = data.get(key);
      if (v == nullptr) throw ProtocolError(quote(key));
      return *v;
    };
    for (const auto& t : need("tensors").as_array("tensors")) index.tensors.push_back(tensor_entry(t, true, held));
    index.generation = need("generation").as_int("generation");
    index.namespace_ = need("namespace").as_str("namespace");
    index.model_type = need("model_type").as_str("model_type");
    index.layout = need("layout").as_str("layout");
    index.config = need("config");
    index.config.as_map("config");
    for (const auto& s : need("segments").as_array("segments")) {
      const auto& m = s.as_map("a segment");
      if (m.size() != 2 || !s.get("name") || !s.get("nbytes"))
        throw ProtocolError("a segment is exactly {name, nbytes}, got " + to_json(s));
      index.segments.push_back({s.get("name")->as_str("a segment's name"), s.get("nbytes")->as_uint("a segment's nbytes")});
    }
    if (const Value* views = data.get("views"); views && !views->is_nil()) {
      index.views.emplace();
      for (const auto& t : views->as_array("views")) index.views->push_back(tensor_entry(t, false, held));
    }
    if (const Value* shm_dir = data.get("shm_dir")) index.shm_dir = shm_dir->as_str("shm_dir");
    if (const Value* ep = data.get("expert_parallel"); ep && !ep->is_nil()) {
      ExpertParallel p;
      const auto& m = ep->as_map("expert_parallel");
      for (const auto& [k, _] : m)
        if (k != "size" && k != "ranks") throw ProtocolError("expert_parallel has an unexpected field " + quote(k));
      const Value* size = ep->get("size");
      if (!size || !size->is_int() || size->is_negative() || size->as_uint() < 1)
        throw ProtocolError("expert_parallel.size must be an integer >= 1");
      p.size = size->as_int();
      if (const Value* ranks = ep->get("ranks")) {
        for (const auto& r : ranks->as_array("expert_parallel.ranks")) p.ranks.push_back(r.as_int("an EP rank"));
        if (p.ranks.empty()) throw ProtocolError("expert_parallel.ranks must be a non-empty list");
      } else {
        for (int64_t r = 0; r < p.size; ++r) p.ranks.push_back(r);
      }
      for (auto r : p.ranks)
        if (r < 0 || r >= p.size) throw ProtocolError("expert_parallel.ranks out of range");
      std::sort(p.ranks.begin(), p.ranks.end());
      if (std::adjacent_find(p.ranks.begin(), p.ranks.end()) != p.ranks.end())
        throw ProtocolError("expert_parallel.ranks names a rank twice");
      index.expert_parallel = p;
    }
  } catch (const ProtocolError& exc) {
    throw ProtocolError(std::string("malformed tensor index: ") + exc.what());
  }
  if (index.shm_dir.empty() || index.shm_dir[0] != '/')
    throw ProtocolError("tensor index: shm_dir " + quote(index.shm_dir) + " must be an absolute path");
  return index;
}

static std::vector<Extent> cut_extents(const std::vector<Extent>& extents, uint64_t start, uint64_t length) {
  std::vector<Extent> out;
  uint64_t at = 0;
  for (const auto& e : extents) {
    uint64_t lo = std::max(start, at), hi = std::min(start + length, at + e.nbytes);
    if (lo < hi) out.push_back({e.segment, e.offset + lo - at, hi - lo});
    at += e.nbytes;
  }
  return out;
}

std::vector<TensorEntry> derive_views(const std::vector<TensorEntry>& tensors) {
  std::vector<TensorEntry> views;
  for (const auto& t : tensors) {
    std::size_t n = t.sources.size();
    if (n == 0 || (n == 1 && t.sources[0] == t.name)) continue;  // computed, or served under its own name
    if (n == 1) {  // served under the model's name for a renamed checkpoint tensor: the whole of it
      TensorEntry v = t;
      v.name = t.sources[0];
      v.base = t.name;
      v.checksum.reset();
      v.experts.reset();
      views.push_back(std::move(v));
      continue;
    }
    if (t.nbytes % n || t.shape.size() < 2 || t.shape[0] <= 0 || n % static_cast<std::size_t>(t.shape[0]) ||
        t.shape[1] % static_cast<int64_t>(n / t.shape[0]))
      throw ProtocolError("fused tensor " + t.name + " " + shape_text(t.shape) + " cannot hold " + std::to_string(n) +
                          " equal sources");
    uint64_t chunk = t.nbytes / n;
    int64_t per_expert = static_cast<int64_t>(n) / t.shape[0];
    std::vector<int64_t> shape{t.shape[1] / per_expert};
    shape.insert(shape.end(), t.shape.begin() + 2, t.shape.end());
    for (std::size_t k = 0; k < n; ++k) {
      TensorEntry v;
      v.name = t.sources[k];
      v.segment = t.segment;
      v.offset = t.offset + k * chunk;
      if (!t.extents.empty()) {  // an expert of a stack made of several generations' ranges: the ranges it covers
        v.extents = cut_extents(t.extents, k * chunk, chunk);
        v.segment = v.extents.front().segment;
        v.offset = v.extents.front().offset;
        if (v.extents.size() == 1) v.extents.clear();
      }
      v.nbytes = chunk;
      v.shape = shape;
      v.dtype = t.dtype;
      v.sources = {t.sources[k]};
      v.base = t.name;
      views.push_back(std::move(v));
    }
  }
  return views;
}

std::vector<TensorEntry> Index::all_views() const { return views ? *views : derive_views(tensors); }

std::map<std::string, TensorEntry> Index::checkpoint_entries() const {
  std::map<std::string, TensorEntry> out;
  for (const auto& t : tensors)
    if (t.sources.size() == 1 && t.sources[0] == t.name) out[t.name] = t;
  for (auto& v : all_views()) out[v.name] = std::move(v);
  return out;
}

}  // namespace expertd
