// Stand-in for gloo's <gloo/common/error.h>: gloo's errors reach us as c10::Error /
// std::exception raised by libtorch, so no gloo type is named here.
#pragma once
#include <stdexcept>
