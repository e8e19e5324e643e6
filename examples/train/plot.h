// examples/train/plot.h — a hand-written SVG loss curve (no plotting dependency).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace train {

// losses[i] is the loss of step first_step + i. The y axis is logarithmic
// when the losses span more than a factor of 20, else linear.
std::string loss_curve_svg(const std::vector<double>& losses, int64_t first_step, const std::string& title);

}  // namespace train
