// max_pool2d: ATen's max pooling, bit for bit, and for each output element the position of its
// maximum inside its window, (row * kernel width + column), in one byte. That is all the backward
// needs: max_pool2d_indices rebuilds ATen's flat indices (row * input width + column) from it
// (ops/max_pool2d.py), where eager keeps the input and the int64 indices.
//
// The conversions are one pass over the indices on CPU for contiguous and channels_last tensors
// (a loop per output row, the inner loop along the smaller stride), ATen's integer ops elsewhere
// and under the generic_path switch (so that the tests check on CPU what a GPU runs).
#include <ATen/Parallel.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/max_pool2d_with_indices.h>
#include <torch/library.h>

#include "../generic_path.h"

#include <array>
#include <tuple>
#include <vector>

namespace fxfuse {

namespace {

using Pair = std::array<int64_t, 2>;

// An int[2] argument as ATen's pooling reads it: one value for both dimensions, or two.
Pair pair(at::IntArrayRef v, Pair if_empty) {
  if (v.empty()) return if_empty;
  return {v[0], v.size() == 1 ? v[0] : v[1]};
}

struct Window {
  Pair k, s, p, d;
  Window(at::IntArrayRef kernel_size, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation)
      : k(pair(kernel_size, {0, 0})), s(pair(stride, k)), p(pair(padding, {0, 0})), d(pair(dilation, {1, 1})) {}
  int64_t row0(int64_t oh) const { return oh * s[0] - p[0]; }
  int64_t col0(int64_t ow) const { return ow * s[1] - p[1]; }
};

bool dense_layout(const at::Tensor& t) {
  return t.is_contiguous() || (t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast));
}

// f(first element, its step, count, oh, ow) for each run of a dense 3-D or 4-D tensor `t` (an
// output of the pooling) that shares one window position (oh, ow): a pixel's channels, or a
// single element where channels are not the inner dimension; in parallel over output rows. The
// kernels copy what they read into locals: their one-byte stores may alias anything else.
template <typename F>
void for_each_window(const at::Tensor& t, F f) {
  const bool batched = t.dim() == 4;
  const int64_t N = batched ? t.size(0) : 1, C = t.size(-3), OH = t.size(-2), OW = t.size(-1);
  const int64_t sN = batched ? t.stride(0) : 0, sC = t.stride(-3), sH = t.stride(-2), sW = t.stride(-1);
  const bool channels_inner = sC < sW;
  at::parallel_for(0, N * OH, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t n = r / OH, oh = r % OH, base = n * sN + oh * sH;
      if (channels_inner) {
        for (int64_t ow = 0; ow < OW; ++ow) f(base + ow * sW, sC, C, oh, ow);
      } else {
        for (int64_t c = 0; c < C; ++c)
          for (int64_t ow = 0; ow < OW; ++ow) f(base + c * sC + ow * sW, int64_t{0}, int64_t{1}, oh, ow);
      }
    }
  });
}

at::Tensor offsets_cpu(const at::Tensor& indices, int64_t width, const Window& w) {
  at::Tensor offsets = at::empty_like(indices, indices.options().dtype(at::kByte));
  const int64_t* idx = indices.const_data_ptr<int64_t>();
  uint8_t* out = offsets.mutable_data_ptr<uint8_t>();
  // A maximum's flat index less its window's first element's is r * width + c (r and c its row
  // and column in the window, multiples of the dilation): where c < width that difference alone
  // gives the offset, looked up; otherwise divide.
  const int64_t last_c = (w.k[1] - 1) * w.d[1];
  if (last_c < width) {
    std::vector<uint8_t> table((w.k[0] - 1) * w.d[0] * width + last_c + 1, 0);
    for (int64_t r = 0; r < w.k[0]; ++r)
      for (int64_t c = 0; c < w.k[1]; ++c) table[r * w.d[0] * width + c * w.d[1]] = static_cast<uint8_t>(r * w.k[1] + c);
    const uint8_t* tab = table.data();
    for_each_window(indices, [&](int64_t i, int64_t step, int64_t count, int64_t oh, int64_t ow) {
      const int64_t first = w.row0(oh) * width + w.col0(ow);
      const int64_t* __restrict src = idx + i;
      uint8_t* __restrict dst = out + i;
      for (int64_t j = 0; j < count; ++j) dst[j * step] = tab[src[j * step] - first];
    });
  } else {
    const int64_t kw = w.k[1], dh = w.d[0], dw = w.d[1];
    for_each_window(indices, [&](int64_t i, int64_t step, int64_t count, int64_t oh, int64_t ow) {
      const int64_t row0 = w.row0(oh), col0 = w.col0(ow);
      for (int64_t j = 0; j < count; ++j) {
        const int64_t flat = idx[i + j * step], h = flat / width;
        out[i + j * step] = static_cast<uint8_t>((h - row0) / dh * kw + (flat - h * width - col0) / dw);
      }
    });
  }
  return offsets;
}

at::Tensor offsets_aten(const at::Tensor& indices, int64_t width, const Window& w, int64_t OH, int64_t OW) {
  const auto opts = indices.options();
  const at::Tensor row0 = at::arange(OH, opts).mul_(w.s[0]).sub_(w.p[0]).unsqueeze_(1);
  const at::Tensor col0 = at::arange(OW, opts).mul_(w.s[1]).sub_(w.p[1]);
  at::Tensor row = at::div(indices, width, "trunc");
  at::Tensor col = indices.sub(row.mul(width));
  row.sub_(row0).div_(w.d[0], "trunc").mul_(w.k[1]);
  col.sub_(col0).div_(w.d[1], "trunc");
  return row.add_(col).to(at::kByte);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> max_pool2d_generic(
    const at::Tensor& input, at::IntArrayRef kernel_size, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode) {
  auto [output, indices] =
      at::max_pool2d_with_indices(input, kernel_size, stride, padding, dilation, ceil_mode);
  const Window w(kernel_size, stride, padding, dilation);
  TORCH_CHECK(
      w.k[0] * w.k[1] <= 256, "fxfuse::max_pool2d: a window of at most 256 elements, got ", w.k[0], "x", w.k[1]);
  const int64_t width = input.size(-1);
  at::Tensor offsets = indices.device().is_cpu() && dense_layout(indices) && !generic_path()
      ? offsets_cpu(indices, width, w)
      : offsets_aten(indices, width, w, output.size(-2), output.size(-1));
  return {output, offsets};
}

at::Tensor max_pool2d_indices_generic(
    const at::Tensor& offsets, int64_t width, at::IntArrayRef kernel_size, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation) {
  TORCH_CHECK(offsets.scalar_type() == at::kByte, "fxfuse::max_pool2d_indices: expected uint8 window offsets");
  TORCH_CHECK(offsets.dim() == 3 || offsets.dim() == 4, "fxfuse::max_pool2d_indices: expected 3-D or 4-D offsets");
  const Window w(kernel_size, stride, padding, dilation);
  TORCH_CHECK(w.k[0] > 0 && w.k[1] > 0 && w.k[0] * w.k[1] <= 256, "fxfuse::max_pool2d_indices: bad kernel_size");
  // Flat index of each position inside a window, relative to the window's first element.
  std::array<int64_t, 256> delta{};
  for (int64_t i = 0; i < w.k[0] * w.k[1]; ++i) delta[i] = (i / w.k[1]) * w.d[0] * width + (i % w.k[1]) * w.d[1];
  if (offsets.device().is_cpu() && dense_layout(offsets) && !generic_path()) {
    at::Tensor indices = at::empty_like(offsets, offsets.options().dtype(at::kLong));
    const uint8_t* off = offsets.const_data_ptr<uint8_t>();
    int64_t* out = indices.mutable_data_ptr<int64_t>();
    const int64_t* tab = delta.data();
    for_each_window(offsets, [&](int64_t i, int64_t step, int64_t count, int64_t oh, int64_t ow) {
      const int64_t first = w.row0(oh) * width + w.col0(ow);
      const uint8_t* __restrict src = off + i;
      int64_t* __restrict dst = out + i;
      for (int64_t j = 0; j < count; ++j) dst[j * step] = first + tab[src[j * step]];
    });
    return indices;
  }
  const auto opts = offsets.options().dtype(at::kLong);
  const at::Tensor first = at::arange(offsets.size(-2), opts).mul_(w.s[0]).sub_(w.p[0]).mul_(width).unsqueeze_(1).add(
      at::arange(offsets.size(-1), opts).mul_(w.s[1]).sub_(w.p[1]));
  at::Tensor off = offsets.to(at::kLong);
  at::Tensor row = at::div(off, w.k[1], "trunc");
  off.sub_(row.mul(w.k[1])).mul_(w.d[1]);
  return row.mul_(w.d[0] * width).add_(off).add_(first);
}

TORCH_LIBRARY_FRAGMENT(fxfuse, m) {
  // F.max_pool2d, returning besides its output where each maximum lies in its window (one byte
  // per output element): its autograd (ops/max_pool2d.py) keeps only those, where eager's keeps
  // the input and int64 indices.
  m.def(
      "max_pool2d(Tensor input, int[2] kernel_size, int[2] stride, int[2] padding, "
      "int[2] dilation, bool ceil_mode) -> (Tensor output, Tensor window_offsets)");
  // ATen's flat indices (row * input_width + column) of max_pool2d's maxima, from its window_offsets.
  m.def(
      "max_pool2d_indices(Tensor window_offsets, int input_width, int[2] kernel_size, int[2] stride, "
      "int[2] padding, int[2] dilation) -> Tensor");
}

TORCH_LIBRARY_IMPL(fxfuse, CompositeExplicitAutograd, m) {
  m.impl("max_pool2d", &max_pool2d_generic);
  m.impl("max_pool2d_indices", &max_pool2d_indices_generic);
}

}  // namespace fxfuse
