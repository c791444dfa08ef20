"""Signal processing: DFT (opsets 17 and 20), STFT (17), Hann / Hamming / Blackman windows (17).

With a static transform length L the DFT is a matmul with constant cos / sin matrices along the axis (built in
float64, used in the input's type): forward X[k] = sum_n x[n] e^(-2 pi i k n / L), inverse with e^(+...) / L;
the signal is zero-padded or truncated to L (rows of the matrix); onesided keeps bins 0..L/2. An inverse
onesided transform (irfft) takes bins 0..L/2 of a Hermitian spectrum (imaginary parts of the DC and Nyquist
bins ignored, as numpy.fft.irfft) and outputs a real signal. STFT gathers the frames with constant indices,
applies the window and the onesided DFT. Windows are computed at run time from their size input.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from opmap.registry import register


def _along(n, x, axis: int, matrix):
    """x @ matrix along `axis` (the axis becomes the matrix's column count)."""
    return n.call("ops.swapaxes", n.call("ops.matmul", n.call("ops.swapaxes", x, axis, -1), matrix), axis, -1)


def _dft(n, x, shape: list, axis: int, length: int | None, inverse: bool, onesided: bool, np_dt):
    """The DFT of x (..., 1 or 2) along axis; returns (..., bins, 2) or, for irfft, (..., L, 1)."""
    size = shape[axis]
    if not isinstance(size, int) or not isinstance(shape[-1], int):
        n.fail("the transformed axis must have a static size")
    complex_in = shape[-1] == 2
    if length is None:
        length = 2 * (size - 1) if inverse and onesided else size
    re = n.getitem(x, (Ellipsis, 0))
    im = n.getitem(x, (Ellipsis, 1)) if complex_in else None
    if inverse and onesided:
        bins = np.arange(min(size, length // 2 + 1))
        weight = np.where((bins == 0) | (2 * bins == length), 1.0, 2.0)[:, None] / length
        theta = 2 * np.pi * np.outer(bins, np.arange(length)) / length
        cos = np.zeros((size, length))
        sin = np.zeros((size, length))
        cos[: len(bins)] = weight * np.cos(theta)
        sin[: len(bins)] = weight * np.sin(theta)
        y = _along(n, re, axis, n.const_tensor(cos.astype(np_dt), "cos"))
        if im is not None:
            y = n.binop("-", y, _along(n, im, axis, n.const_tensor(sin.astype(np_dt), "sin")))
        return n.call("ops.expand_dims", y, -1)
    out_bins = length // 2 + 1 if onesided else length
    used = min(size, length)
    theta = 2 * np.pi * np.outer(np.arange(used), np.arange(out_bins)) / length
    cos = np.zeros((size, out_bins))
    sin = np.zeros((size, out_bins))
    cos[:used], sin[:used] = np.cos(theta), np.sin(theta)
    if inverse:
        cos, sin = cos / length, sin / length
    c = n.const_tensor(cos.astype(np_dt), "cos")
    s = n.const_tensor(sin.astype(np_dt), "sin")
    sign = "+" if inverse else "-"
    other = "-" if inverse else "+"
    if im is None:
        real, imag = _along(n, re, axis, c), _along(n, re, axis, s)
        if not inverse:
            imag = n.unop("-", imag)
    else:
        real = n.binop(other, _along(n, re, axis, c), _along(n, im, axis, s))
        imag = n.binop(sign, _along(n, im, axis, c), _along(n, re, axis, s))
    return n.call("ops.stack", (real, imag), -1)


def _dft_node(n, axis: int, length_input: int | None):
    shape = n.shape(0)
    if shape is None:
        n.fail("the input rank is unknown")
    rank = len(shape)
    axis = axis % rank
    if axis == rank - 1:
        n.fail("the last axis holds the real / imaginary parts and cannot be transformed")
    length = None
    if length_input is not None and n.has(length_input):
        length = n.require_ints(length_input, "dft_length")[0]
    return _dft(n, n.x(0), shape, axis, length, bool(n.attr("inverse", 0)), bool(n.attr("onesided", 0)),
                n.dtype(0).numpy())


@register("DFT", since=17)
def dft17(n):
    """Opset 17: axis is an attribute (default 1)."""
    return _dft_node(n, int(n.attr("axis", 1)), 1)


@register("DFT", since=20)
def dft20(n):
    """Opset 20: axis is an input (default -2)."""
    axis = n.require_ints(2, "DFT axis")[0] if n.has(2) else -2
    return _dft_node(n, axis, 1)


@register("STFT", since=17)
def stft(n):
    shape = n.shape(0)
    if shape is None or not all(isinstance(d, int) for d in shape[1:]):
        n.fail("the signal must have a static length")
    step = n.require_ints(1, "STFT frame_step")[0]
    window = n.x(2) if n.has(2) else None
    if n.has(3):
        frame = n.require_ints(3, "STFT frame_length")[0]
    elif window is not None and isinstance((n.shape(2) or [None])[0], int):
        frame = n.shape(2)[0]
    elif window is None:
        frame = shape[1]
    else:
        n.fail("the frame length is unknown")
    frames = 1 + (shape[1] - frame) // step
    index = (np.arange(frames)[:, None] * step + np.arange(frame)[None, :]).astype(np.int64)
    x = n.call("ops.gather", n.x(0), n.const_tensor(index, "frames"), 1)  # (B, F, L, c)
    if window is not None:
        x = n.binop("*", x, n.call("ops.reshape", window, (1, 1, -1, 1)))
    onesided = bool(n.attr("onesided", 1))
    return _dft(n, x, [shape[0], frames, frame, shape[2]], 2, frame, False, onesided, n.dtype(0).numpy())


def _window(n, terms):
    """sum_k a_k cos(k * 2 pi n / N) for n in [0, size), N = size (periodic) or size - 1 (symmetric)."""
    dt = n.attr("output_datatype", 1)
    i64, f64 = n.ms_dtype(ir.DataType.INT64), n.ms_dtype(ir.DataType.DOUBLE)
    size = n.call("ops.cast", n.x(0), i64)
    pos = n.call("ops.cast", n.call("ops.range", n.call("Tensor", 0, i64), size, n.call("Tensor", 1, i64)), f64)
    denom = n.call("ops.cast", size, f64) if n.attr("periodic", 1) else n.call("ops.cast", n.binop("-", size, 1), f64)
    phase = n.binop("/", n.binop("*", pos, 2 * np.pi), denom)
    total = None
    for k, a in terms:
        term = a if k == 0 else n.binop("*", a, n.call("ops.cos", n.binop("*", float(k), phase)))
        total = term if total is None else n.binop("+", total, term)
    return n.call("ops.cast", total, n.ms_dtype(dt))


@register("HannWindow", since=17)
def hann_window(n):
    return _window(n, [(0, 0.5), (1, -0.5)])


@register("HammingWindow", since=17)
def hamming_window(n):
    alpha = 25.0 / 46.0
    return _window(n, [(0, alpha), (1, -(1 - alpha))])


@register("BlackmanWindow", since=17)
def blackman_window(n):
    return _window(n, [(0, 0.42), (1, -0.5), (2, 0.08)])
