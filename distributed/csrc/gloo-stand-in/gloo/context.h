// Stand-in for gloo's <gloo/context.h>: the PyTorch wheel ships c10d's headers but not gloo's.
// ProcessGroupGloo.hpp only holds contexts by shared_ptr and calls setTimeout in an inline
// method we never call, so a declaration suffices (the real class lives in libtorch_cpu.so).
#pragma once
#include <chrono>

namespace gloo {
class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);
};
} // namespace gloo
