// TurboQuant-Prod's key parameters on CUDA (kvq-kernels spec.rs KeySpec::ScalarSketch): the
// scalar stage's codebook and rotation, then the residual's Gaussian sign sketch.
#pragma once
#include "../common/sketch.cuh"
#include "../turboquant_mse/scalar.cuh"

namespace kvq {

struct ProdParams {
  ScalarParams scalar;
  SketchParams sketch;
};

}  // namespace kvq
