// The torch headers every source of the CPU kernel library includes first, as its first line:
// `#include <torch_headers.h>`. The build precompiles this header once per build directory
// (radixrt/attention/cpu_kernels.py, `_precompile_headers`) with the flags each source gets, and
// GCC then loads it in ~3 s instead of parsing these headers for ~15 s in every source. Without
// the precompiled file (another compiler, a failed precompile) the header is parsed as usual:
// same objects, slower build. fused_ops.cpp does not include it (its `fp-contract=off` pragma
// must come before the torch headers).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>
