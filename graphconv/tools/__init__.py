"""Tools around the compiler: the opset matrix, the ONNX conformance run and its backend, and
`graphconv inspect`."""
