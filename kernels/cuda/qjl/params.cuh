// QJL's parameters on CUDA (kvq-kernels spec.rs KeySpec::Sketch, ValueSpec::Group): the keys'
// Gaussian sign sketch with its exact outlier channels, and the values' groupwise codes.
#pragma once
#include "../common/sketch.cuh"

namespace kvq {

struct QjlKeyParams {
  SketchParams sketch;
  int outliers;
};

struct GroupParams {
  int bits;   // 2, 4 or 8
  int group;  // coordinates per group (a multiple of 8)
};

}  // namespace kvq
