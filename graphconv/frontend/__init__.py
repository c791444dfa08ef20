"""The front end: loading an ONNX model and its weights, exporting one from PyTorch, and the
weights' own (state_dict) names."""
