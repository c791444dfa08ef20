"""The compiler to MindSpore: the targets, the lowering (opmap handlers through the node context into the
program IR), repeated layers and the partition into blocks, code generation and compile-time constant folding.
It writes programs and never runs them (graphconv/runtime does)."""
