// Stand-in for gloo's <gloo/algorithm.h>: nothing of it is used through c10d::Backend.
#pragma once
#include <gloo/context.h>
