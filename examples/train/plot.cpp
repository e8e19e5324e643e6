// examples/train/plot.cpp — the SVG loss curve: axes, ticks, grid, one polyline.
#include "plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace train {
namespace {

std::string fmt(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3g", v);
  return b;
}

std::string escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '&')
      o += "&amp;";
    else if (c == '<')
      o += "&lt;";
    else if (c == '>')
      o += "&gt;";
    else
      o += c;
  }
  return o;
}

// About n "nice" tick values (1, 2, 5 × 10^k) covering [lo, hi].
std::vector<double> nice_ticks(double lo, double hi, int n) {
  const double raw = (hi - lo) / std::max(n, 1);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  std::vector<double> t;
  for (double v = std::ceil(lo / step) * step; v <= hi + 1e-9 * step; v += step) t.push_back(v);
  return t;
}

}  // namespace

std::string loss_curve_svg(const std::vector<double>& losses_in, int64_t first_step, const std::string& title) {
  const double W = 720, H = 440, L = 80, R = 20, T = 40, B = 50;  // size and margins
  std::vector<double> losses;
  for (double l : losses_in) losses.push_back(std::isfinite(l) ? l : 0.0);
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" viewBox=\"0 0 " << W
    << " " << H << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"" << W / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">" << escape(title) << "</text>\n";
  if (losses.empty()) {
    o << "<text x=\"" << W / 2 << "\" y=\"" << H / 2 << "\" text-anchor=\"middle\">no steps</text>\n</svg>\n";
    return o.str();
  }
  double lo = *std::min_element(losses.begin(), losses.end()), hi = *std::max_element(losses.begin(), losses.end());
  const bool log_y = lo > 0 && hi / lo > 20;
  auto ty = [&](double v) { return log_y ? std::log10(v) : v; };
  double y0 = ty(lo), y1 = ty(hi);
  if (!log_y) y0 = std::min(0.0, y0);  // a linear axis starts at 0 for losses
  if (y1 - y0 < 1e-12) y1 = y0 + 1;
  const double x0 = static_cast<double>(first_step);
  const double x1 = std::max(x0 + 1, static_cast<double>(first_step + static_cast<int64_t>(losses.size()) - 1));
  auto px = [&](double s) { return L + (s - x0) / (x1 - x0) * (W - L - R); };
  auto py = [&](double v) { return H - B - (ty(v) - y0) / (y1 - y0) * (H - T - B); };

  // Grid and ticks.
  o << "<g stroke=\"#ddd\">\n";
  std::vector<double> yt;
  if (log_y) {
    for (double e = std::floor(y0); e <= std::ceil(y1); e += 1)
      for (double m : {1.0, 2.0, 5.0}) {
        const double v = m * std::pow(10.0, e);
        if (ty(v) >= y0 - 1e-12 && ty(v) <= y1 + 1e-12) yt.push_back(v);
      }
  } else {
    yt = nice_ticks(y0, y1, 6);
  }
  for (double v : yt)
    o << "<line x1=\"" << L << "\" x2=\"" << W - R << "\" y1=\"" << py(v) << "\" y2=\"" << py(v) << "\"/>\n";
  const std::vector<double> xt = nice_ticks(x0, x1, 8);
  for (double s : xt)
    o << "<line x1=\"" << px(s) << "\" x2=\"" << px(s) << "\" y1=\"" << T << "\" y2=\"" << H - B << "\"/>\n";
  o << "</g>\n";
  for (double v : yt)
    o << "<text x=\"" << L - 6 << "\" y=\"" << py(v) + 4 << "\" text-anchor=\"end\">" << fmt(v) << "</text>\n";
  for (double s : xt)
    o << "<text x=\"" << px(s) << "\" y=\"" << H - B + 16 << "\" text-anchor=\"middle\">" << fmt(s) << "</text>\n";
  // Axes and labels.
  o << "<path d=\"M" << L << " " << T << " V" << H - B << " H" << W - R << "\" stroke=\"black\" fill=\"none\"/>\n"
    << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 12 << "\" text-anchor=\"middle\">step</text>\n"
    << "<text x=\"18\" y=\"" << (T + H - B) / 2 << "\" text-anchor=\"middle\" transform=\"rotate(-90 18 "
    << (T + H - B) / 2 << ")\">loss" << (log_y ? " (log scale)" : "") << "</text>\n";
  // The curve.
  o << "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"2\" points=\"";
  for (size_t i = 0; i < losses.size(); ++i) {
    const double v = log_y ? std::max(losses[i], lo) : losses[i];
    o << (i ? " " : "") << px(x0 + static_cast<double>(i)) << "," << py(v);
  }
  o << "\"/>\n";
  o << "<text x=\"" << W - R - 6 << "\" y=\"" << T + 16 << "\" text-anchor=\"end\" fill=\"#555\">first "
    << fmt(losses.front()) << ", last " << fmt(losses.back()) << "</text>\n";
  o << "</svg>\n";
  return o.str();
}

}  // namespace train
