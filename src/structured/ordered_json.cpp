#include "structured/ordered_json.h"

#include <string>
#include <unordered_map>
#include <vector>

#include "util/error.h"

namespace tandem::structured {
namespace {

using json = nlohmann::ordered_json;

// nlohmann's SAX parser (iterative) feeding a builder that appends each member to its object's
// vector directly and finds duplicates by hash, instead of the ordered map's linear search.
class Builder {
 public:
  explicit Builder(size_t max_depth) : max_depth_(max_depth) {}
  json root;

  bool null() { return put(nullptr); }
  bool boolean(bool v) { return put(v); }
  bool number_integer(json::number_integer_t v) { return put(v); }
  bool number_unsigned(json::number_unsigned_t v) { return put(v); }
  bool number_float(json::number_float_t v, const json::string_t&) { return put(v); }
  bool string(json::string_t& v) { return put(std::move(v)); }
  bool binary(json::binary_t&) { throw Error("JSON: binary values are not JSON"); }
  bool start_object(size_t) { return open(json::object()); }
  bool start_array(size_t) { return open(json::array()); }
  bool key(json::string_t& k) {
    key_ = std::move(k);
    return true;
  }
  bool end_object() {
    open_.pop_back();
    return true;
  }
  bool end_array() { return end_object(); }
  bool parse_error(size_t at, const std::string&, const nlohmann::detail::exception& e) {
    throw Error("JSON at byte " + std::to_string(at) + ": " + e.what());
  }

 private:
  struct Open {
    json* container;
    std::unordered_map<std::string, size_t> keys;  // objects: member index by key
  };

  bool open(json&& empty) {
    if (open_.size() >= max_depth_)
      throw Error("JSON nesting is deeper than " + std::to_string(max_depth_) + " levels");
    json* slot = place(std::move(empty));
    open_.push_back({slot, {}});
    return true;
  }
  bool put(json&& v) {
    place(std::move(v));
    return true;
  }
  // Where a value goes: the root, the end of the open array, or the open object's member.
  // Pointers into a container stay valid while it is open: only the innermost grows.
  json* place(json&& v) {
    if (open_.empty()) {
      root = std::move(v);
      return &root;
    }
    Open& o = open_.back();
    if (o.container->is_array()) {
      o.container->get_ref<json::array_t&>().push_back(std::move(v));
      return &o.container->get_ref<json::array_t&>().back();
    }
    // The map's vector, indexed and appended to without its search by key.
    auto& members =
        static_cast<json::object_t::Container&>(o.container->get_ref<json::object_t&>());
    const auto [at, added] = o.keys.emplace(key_, members.size());
    if (!added) {
      members[at->second].second = std::move(v);
      return &members[at->second].second;
    }
    members.emplace_back(std::move(key_), std::move(v));
    return &members.back().second;
  }

  size_t max_depth_;
  std::vector<Open> open_;
  std::string key_;
};

}  // namespace

json parse_ordered(std::string_view text, size_t max_depth) {
  Builder b(max_depth);
  json::sax_parse(text.begin(), text.end(), &b);
  return std::move(b.root);
}

void check_object_sizes(const json& doc) {
  std::vector<const json*> pending = {&doc};
  while (!pending.empty()) {
    const json* j = pending.back();
    pending.pop_back();
    if (j->is_object() && j->size() > kMaxObjectKeys)
      throw Error("an object of " + std::to_string(j->size()) + " keys (at most " +
                  std::to_string(kMaxObjectKeys) + ")");
    if (j->is_structured())
      for (const auto& child : *j) pending.push_back(&child);
  }
}

}  // namespace tandem::structured
