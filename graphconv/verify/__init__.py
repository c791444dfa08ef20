"""Verification: reference inputs and the onnxruntime oracle, the comparison rule, the
primitive census of a MindIR, and pass-by-pass debugging."""
