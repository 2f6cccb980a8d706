// Stand-in for gloo's <gloo/rendezvous/store.h>: c10d's inline GlooStore overrides these
// virtuals. GlooStore is only constructed inside libtorch, so this declaration never decides an
// object's layout in our code.
#pragma once
#include <chrono>
#include <string>
#include <vector>

namespace gloo {
namespace rendezvous {
class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<char>& data) = 0;
  virtual std::vector<char> get(const std::string& key) = 0;
  virtual void wait(const std::vector<std::string>& keys) = 0;
  virtual void wait(
      const std::vector<std::string>& keys,
      const std::chrono::milliseconds& timeout) = 0;
};
} // namespace rendezvous
} // namespace gloo
