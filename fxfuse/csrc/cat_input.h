// The kernel of fxfuse::cat_<op> on every device: <op> run on `input`, the concatenation of
// `pieces` along dim 1 that the caller computed, once the pieces are checked to make it up. The
// Autograd kernel (autograd/<op>.cpp) keeps the pieces instead of the input; ops/cat_input.py
// defines the schemas (from <op>'s) and the fake kernels, whose checks handle symbolic shapes.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <sstream>

namespace fxfuse::cat_input {

// A shape as Python writes a tuple, so that these messages read as the fake kernel's.
inline std::string shape(at::IntArrayRef sizes) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < sizes.size(); ++i) s << (i ? ", " : "") << sizes[i];
  s << (sizes.size() == 1 ? ",)" : ")");
  return s.str();
}

inline void check_pieces(at::TensorList pieces, const at::Tensor& input) {
  TORCH_CHECK(!pieces.empty(), "fxfuse::cat_*: expected at least one piece");
  const int64_t dim = input.dim();
  TORCH_CHECK(
      dim >= 2, "fxfuse::cat_*: expected an input of at least 2 dims (N, C, ...), got ", dim, "-D");
  int64_t channels = 0;
  for (const at::Tensor& piece : pieces) {
    bool fits = piece.dim() == dim && piece.size(0) == input.size(0);
    for (int64_t d = 2; fits && d < dim; ++d) fits = piece.size(d) == input.size(d);
    TORCH_CHECK(
        fits, "fxfuse::cat_*: a piece of shape ", shape(piece.sizes()),
        " cannot be part of an input of shape ", shape(input.sizes()),
        " concatenated along dim 1");
    channels += piece.size(1);
  }
  TORCH_CHECK(
      channels == input.size(1), "fxfuse::cat_*: the pieces' channels add up to ", channels,
      ", the input has ", input.size(1));
}

// Of<decltype(op)>::kernel<kName>: the cat_ variant's kernel of the op named kName, whose C++
// signature is `Fn` (the input first).
template <class Fn>
struct Of;
template <class R, class... Rest>
struct Of<R(const at::Tensor&, Rest...)> {
  template <const char* kName>
  static R kernel(at::TensorList pieces, const at::Tensor& input, Rest... rest) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow(kName, "")
                         .template typed<R(const at::Tensor&, Rest...)>();
    check_pieces(pieces, input);
    return op.call(input, rest...);
  }
};

}  // namespace fxfuse::cat_input
