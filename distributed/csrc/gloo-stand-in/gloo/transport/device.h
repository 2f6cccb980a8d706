// Stand-in for gloo's <gloo/transport/device.h>: devices and buffers are only held by pointer.
#pragma once

namespace gloo {
namespace transport {
class Device;
class UnboundBuffer;
} // namespace transport
} // namespace gloo
